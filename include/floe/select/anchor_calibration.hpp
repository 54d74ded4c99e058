// Chooses an anchor_plan on a development set (Kascade): each decode step, every
// (layer, KV head) reports its group-summed attention weights; the calibration measures how
// much of (l, h)'s weight falls in the top k of (a, h') for every a <= l, averages that over
// steps, maps each head to its best source head and picks the anchors by choose_anchors.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/selection.hpp"
#include "floe/select/anchor_plan.hpp"
#include "floe/select/scorers/group_weights.hpp"

namespace floe::select {

class anchor_calibration {
 public:
  // fraction: the share of the cache an anchor attends (its k = ceil(fraction * n)).
  anchor_calibration(index_t layers, index_t kv_heads, double fraction)
      : layers_(layers), heads_(kv_heads), fraction_(fraction), weights_(slots()),
        share_(static_cast<std::size_t>(slots()) * slots(), 0.0) {
    require(layers > 0 && kv_heads > 0, "layers", "needs at least one layer and one KV head, got ", layers, " x ",
            kv_heads);
    require(fraction > 0.0 && fraction <= 1.0, "fraction", "must lie in (0, 1], got ", fraction);
  }

  // The weights of (layer, head) at this step over its n tokens (any positive scale).
  void observe(index_t layer, index_t head, std::span<const float> weight) {
    require(layer < layers_ && head < heads_, "layer", "(layer ", layer, ", head ", head, ") is outside ", layers_,
            " x ", heads_);
    require(!weight.empty(), "weight", "is empty");
    double sum = 0.0;
    for (float w : weight) {
      require(std::isfinite(w) && w >= 0.f, "weight", "must be finite and non-negative, got ", w);
      sum += w;
    }
    require(sum > 0.0, "weight", "sums to 0");
    auto& mine = weights_[layer * heads_ + head];
    mine.resize(weight.size());
    for (std::size_t i = 0; i < weight.size(); ++i) mine[i] = static_cast<float>(weight[i] / sum);
  }

  // Closes a step: every slot must have been observed over the same n tokens.
  void end_step() {
    const std::size_t n = weights_[0].size();
    for (index_t s = 0; s < slots(); ++s)
      require(!weights_[s].empty() && weights_[s].size() == n, "observe", "(layer ", s / heads_, ", head ",
              s % heads_, ") has ", weights_[s].size(), " weights this step, (0, 0) has ", n);
    const auto k = static_cast<index_t>(std::min<double>(static_cast<double>(n), std::ceil(fraction_ * n)));
    selection top;
    for (index_t a = 0; a < slots(); ++a) {
      top.clear();
      if (k >= n) top.add(0, static_cast<index_t>(n));
      else add_top_k(weights_[a], k, top);
      for (index_t b = (a / heads_) * heads_; b < slots(); ++b) {  // every slot of layer a or later
        double in = 0.0;
        for (const auto& r : top.ranges)
          for (index_t i = r.begin; i < r.end; ++i) in += weights_[b][i];
        share_[a * slots() + b] += in;
      }
    }
    for (auto& w : weights_) w.clear();
    ++steps_;
  }

  index_t steps() const { return steps_; }

  // Mean share of (l, h)'s weight inside the top k of (a, ha), for a <= l.
  double similarity(index_t a, index_t ha, index_t l, index_t h) const {
    require(steps_ > 0, "steps", "no step has ended yet");
    require(a <= l && l < layers_ && ha < heads_ && h < heads_, "layer", "needs a <= l < ", layers_, " and heads < ",
            heads_);
    return share_[(a * heads_ + ha) * slots() + l * heads_ + h] / steps_;
  }

  // The head of layer a that (l, h) reads best from (its own head when a == l).
  index_t best_head(index_t a, index_t l, index_t h) const {
    if (a == l) return h;
    index_t best = 0;
    for (index_t ha = 1; ha < heads_; ++ha)
      if (similarity(a, ha, l, h) > similarity(a, best, l, h)) best = ha;
    return best;
  }

  // similarity of layer l reusing anchor a: the mean over l's heads of their best source.
  // head_aware = false reads head h of a for head h of l.
  std::vector<double> layer_similarity(bool head_aware = true) const {
    std::vector<double> s(static_cast<std::size_t>(layers_) * layers_, 0.0);
    for (index_t a = 0; a < layers_; ++a)
      for (index_t l = a; l < layers_; ++l) {
        double sum = 0.0;
        for (index_t h = 0; h < heads_; ++h) sum += similarity(a, head_aware ? best_head(a, l, h) : h, l, h);
        s[a * layers_ + l] = sum / heads_;
      }
    return s;
  }

  // The plan with `anchors` anchor layers besides the dense ones, chosen and head-mapped as
  // the class comment says.
  anchor_plan plan(index_t anchors, bool head_aware = true, std::vector<index_t> dense = {}) const {
    // The dynamic programme runs over the layers that are not dense.
    const auto all = layer_similarity(head_aware);
    std::vector<index_t> kept;
    for (index_t l = 0; l < layers_; ++l)
      if (std::find(dense.begin(), dense.end(), l) == dense.end()) kept.push_back(l);
    const auto m = static_cast<index_t>(kept.size());
    std::vector<double> sub(static_cast<std::size_t>(m) * m);
    for (index_t a = 0; a < m; ++a)
      for (index_t l = 0; l < m; ++l) sub[a * m + l] = all[kept[a] * layers_ + kept[l]];
    std::vector<index_t> chosen;
    if (m > 0)
      for (index_t i : choose_anchors(sub, m, anchors)) chosen.push_back(kept[i]);
    auto p = anchor_plan::from_anchors(layers_, heads_, chosen, std::move(dense));
    if (head_aware)
      for (index_t l = 0; l < layers_; ++l)
        for (index_t h = 0; h < heads_; ++h) p.head_of[l * heads_ + h] = best_head(p.anchor_of[l], l, h);
    return p;
  }

 private:
  index_t slots() const { return layers_ * heads_; }

  index_t layers_, heads_;
  double fraction_;
  index_t steps_ = 0;
  std::vector<std::vector<float>> weights_;  // this step's normalised weights per slot
  std::vector<double> share_;                // [slot a][slot b], summed over steps
};

}  // namespace floe::select
