// Cross-layer reuse of exact sets (Kascade): which layers choose their own top-k (the
// anchors), which anchor every other layer reuses, and which KV head of that anchor each
// of its KV heads reads. Also the store through which the anchors hand their sets on.
// docs/methods/anchor-reuse.md.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/selection.hpp"

namespace floe::select {

struct anchor_plan {
  index_t layers = 0;
  index_t kv_heads = 0;
  std::vector<index_t> anchor_of;  // [layers]: the anchor layer l reuses; anchor_of[l] == l for an anchor
  std::vector<index_t> head_of;    // [layers * kv_heads]: the KV head of anchor_of[l] that (l, h) reads
  // Layers that attend every token (Kascade keeps layer 0 dense: its attention is flat).
  // They are their own anchor and no other layer's.
  std::vector<index_t> dense_layers;

  bool is_dense(index_t layer) const {
    return std::find(dense_layers.begin(), dense_layers.end(), layer) != dense_layers.end();
  }
  bool is_anchor(index_t layer) const { return anchor_of[layer] == layer; }
  index_t source_head(index_t layer, index_t head) const { return head_of[layer * kv_heads + head]; }

  std::vector<index_t> anchors() const {
    std::vector<index_t> a;
    for (index_t l = 0; l < layers; ++l)
      if (is_anchor(l) && !is_dense(l)) a.push_back(l);
    return a;
  }

  // Every layer from an anchor up to the next reuses that anchor, head h reading head h;
  // dense layers stand apart. The first layer that is not dense must be an anchor.
  static anchor_plan from_anchors(index_t layers, index_t kv_heads, const std::vector<index_t>& anchors,
                                  std::vector<index_t> dense = {}) {
    require(layers > 0 && kv_heads > 0, "plan", "needs at least one layer and one KV head, got ", layers, " x ",
            kv_heads);
    anchor_plan p{layers, kv_heads, std::vector<index_t>(layers, layers), std::vector<index_t>(layers * kv_heads),
                  std::move(dense)};
    for (index_t l : p.dense_layers) {
      require(l < layers, "dense_layers", "layer ", l, " is outside [0, ", layers, ")");
      p.anchor_of[l] = l;
    }
    index_t first = 0;
    while (first < layers && p.is_dense(first)) ++first;
    require(first == layers ? anchors.empty() : !anchors.empty() && anchors.front() == first, "anchors",
            "must start with layer ", first, ", the first layer that is not dense (nothing precedes it)");
    for (std::size_t i = 0; i < anchors.size(); ++i) {
      require(anchors[i] < layers, "anchors", "layer ", anchors[i], " is outside [0, ", layers, ")");
      require(!p.is_dense(anchors[i]), "anchors", "layer ", anchors[i], " is dense");
      require(i == 0 || anchors[i] > anchors[i - 1], "anchors", "must increase; ", anchors[i], " follows ",
              anchors[i == 0 ? 0 : i - 1]);
      const index_t end = i + 1 < anchors.size() ? anchors[i + 1] : layers;
      for (index_t l = anchors[i]; l < end; ++l)
        if (!p.is_dense(l)) p.anchor_of[l] = anchors[i];
    }
    for (index_t l = 0; l < layers; ++l)
      for (index_t h = 0; h < kv_heads; ++h) p.head_of[l * kv_heads + h] = h;
    return p;
  }

  void validate() const {
    require(layers > 0 && kv_heads > 0, "plan", "needs at least one layer and one KV head, got ", layers, " x ",
            kv_heads);
    require(anchor_of.size() == layers, "plan", "anchor_of has ", anchor_of.size(), " entries for ", layers,
            " layers");
    require(head_of.size() == static_cast<std::size_t>(layers) * kv_heads, "plan", "head_of has ", head_of.size(),
            " entries for ", layers, " x ", kv_heads, " (layer, KV head) pairs");
    for (index_t l : dense_layers) require(l < layers, "plan", "dense layer ", l, " is outside [0, ", layers, ")");
    for (index_t l = 0; l < layers; ++l) {
      const index_t a = anchor_of[l];
      require(a <= l, "plan", "layer ", l, " reuses layer ", a, ", which runs after it");
      require(anchor_of[a] == a, "plan", "layer ", l, " reuses layer ", a, ", which is not an anchor");
      require(a == l || !is_dense(a), "plan", "layer ", l, " reuses layer ", a, ", which is dense");
      require(!is_dense(l) || a == l, "plan", "dense layer ", l, " reuses layer ", a);
      for (index_t h = 0; h < kv_heads; ++h) {
        const index_t s = head_of[l * kv_heads + h];
        require(s < kv_heads, "plan", "(layer ", l, ", head ", h, ") reads head ", s, " of ", kv_heads);
        require(a != l || s == h, "plan", "anchor layer ", l, " head ", h, " must read its own set, not head ", s);
      }
    }
  }
};

// The anchors L_1 = 0 < L_2 < ... < L_m that maximise sum_l similarity[anchor(l)][l], where
// anchor(l) is the last anchor at or before l: the dynamic programme of Kascade, exact in
// O(m L^2). similarity is [layers x layers], row a, column l (only a <= l is read).
inline std::vector<index_t> choose_anchors(const std::vector<double>& similarity, index_t layers, index_t count) {
  require(layers > 0 && similarity.size() == static_cast<std::size_t>(layers) * layers, "similarity",
          "must hold layers x layers = ", layers, " x ", layers, " values, got ", similarity.size());
  require(count >= 1 && count <= layers, "count", "anchors must lie in [1, ", layers, "], got ", count);
  for (double s : similarity) require(s == s, "similarity", "contains NaN");
  // segment(a, e): layers a .. e-1 all reuse anchor a.
  std::vector<double> prefix(static_cast<std::size_t>(layers) * (layers + 1), 0.0);
  for (index_t a = 0; a < layers; ++a)
    for (index_t l = a; l < layers; ++l)
      prefix[a * (layers + 1) + l + 1] = prefix[a * (layers + 1) + l] + similarity[a * layers + l];
  const auto segment = [&](index_t a, index_t e) { return prefix[a * (layers + 1) + e] - prefix[a * (layers + 1) + a]; };
  constexpr double none = -std::numeric_limits<double>::infinity();
  // best[c][e]: c anchors covering layers 0 .. e-1 exactly, the last segment ending at e;
  // from[c][e]: where that last segment starts.
  std::vector<std::vector<double>> best(count + 1, std::vector<double>(layers + 1, none));
  std::vector<std::vector<index_t>> from(count + 1, std::vector<index_t>(layers + 1, 0));
  best[0][0] = 0.0;
  for (index_t c = 1; c <= count; ++c)
    for (index_t e = c; e <= layers; ++e)
      for (index_t a = c - 1; a < e; ++a)
        if (best[c - 1][a] != none && best[c - 1][a] + segment(a, e) > best[c][e]) {
          best[c][e] = best[c - 1][a] + segment(a, e);
          from[c][e] = a;
        }
  std::vector<index_t> anchors(count);
  for (index_t c = count, e = layers; c >= 1; --c) e = anchors[c - 1] = from[c][e];
  return anchors;
}

// The exact sets the anchor layers chose at the current step, one slot per (layer, KV
// head). An anchor layer writes its slots; the layers after it read them. Run the layers of
// a step in order; the KV heads of one layer may run in parallel (their slots are apart).
class anchor_store {
 public:
  explicit anchor_store(const anchor_plan& plan) : plan_(plan), slots_(plan.anchor_of.size() * plan.kv_heads) {
    plan_.validate();
  }

  const anchor_plan& plan() const { return plan_; }

  void put(index_t layer, index_t head, index_t n, const std::vector<token_range>& ranges) {
    slot& s = at(layer, head);
    s.ranges = ranges;
    s.n = n;
  }

  // The set (layer, head) reuses at a cache of n tokens: refused ("store") unless its anchor
  // chose one at this n, i.e. earlier in this step.
  const std::vector<token_range>& reused(index_t layer, index_t head, index_t n) const {
    const index_t a = plan_.anchor_of[layer], h = plan_.source_head(layer, head);
    const slot& s = slots_[a * plan_.kv_heads + h];
    require(s.n != none, "store", "layer ", layer, " reuses anchor layer ", a, " head ", h,
            ", which has not chosen yet: run the anchor layer first in each step");
    require(s.n == n, "store", "layer ", layer, " reuses anchor layer ", a, " head ", h, ", which last chose at n = ",
            s.n, " (n = ", n, " now): run the anchor layer first in each step");
    return s.ranges;
  }

 private:
  static constexpr index_t none = std::numeric_limits<index_t>::max();
  struct slot {
    std::vector<token_range> ranges;
    index_t n = none;
  };
  slot& at(index_t layer, index_t head) {
    require(layer < plan_.layers && head < plan_.kv_heads, "store", "(layer ", layer, ", head ", head,
            ") is outside the plan's ", plan_.layers, " x ", plan_.kv_heads);
    return slots_[layer * plan_.kv_heads + head];
  }

  anchor_plan plan_;
  std::vector<slot> slots_;
};

}  // namespace floe::select
