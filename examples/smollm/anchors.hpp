// Kascade's cross-layer reuse in this engine: calibrating an anchor plan on a development
// text (dense decode steps that also report every layer's attention weights), the plan as
// a JSON file, and the anchor_reuse decode method made per (layer, KV head) from a plan.
#pragma once

#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attention.hpp"
#include "floe/any_estimator.hpp"
#include "floe/core/budget.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/io/json.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/anchor_calibration.hpp"
#include "floe/select/anchor_reuse.hpp"

namespace smollm {

// Dense decode (through `dense`) that also hands each (layer, KV head)'s group-summed
// attention weights to the calibration, and closes a step after the last layer.
class calibrating_attention final : public decode_attention {
 public:
  calibrating_attention(std::unique_ptr<decode_attention> dense, floe::select::anchor_calibration& cal)
      : dense_(std::move(dense)), cal_(cal) {}

  std::string name() const override { return "dense (calibrating anchors)"; }
  void build(const llama_config& c, const kv_cache& cache) override { dense_->build(c, cache); }

  void decode(const llama_config& c, int layer, const matrix& q, const kv_cache& cache, int pos, matrix& out,
              floe::stats& io) override {
    const auto hd = static_cast<floe::index_t>(c.head_dim), group = static_cast<floe::index_t>(c.group());
    for (int g = 0; g < c.n_head_kv; ++g) {
      const auto kv = layer_view(cache, layer, g, pos + 1);
      floe::select::group_attention_weights(kv, floe::query_group::make(q.row(0).data() + g * group * hd, group, hd),
                                            exec_, z_, weight_);
      cal_.observe(static_cast<floe::index_t>(layer), static_cast<floe::index_t>(g), weight_);
    }
    dense_->decode(c, layer, q, cache, pos, out, io);
    if (layer + 1 == c.n_layer) cal_.end_step();
  }

 private:
  std::unique_ptr<decode_attention> dense_;
  floe::select::anchor_calibration& cal_;
  floe::exec::simd exec_{};
  std::vector<float> z_, weight_;
};

inline floe::io::json index_array(const std::vector<floe::index_t>& v) {
  floe::io::json::array a;
  for (auto x : v) a.emplace_back(static_cast<double>(x));
  return a;
}

inline std::string plan_json(const floe::select::anchor_plan& p, const floe::select::anchor_calibration& cal,
                             double fraction, const std::string& source) {
  const auto sim = cal.layer_similarity(true);
  floe::io::json::array rows;
  for (floe::index_t a = 0; a < p.layers; ++a) {
    floe::io::json::array row;
    for (floe::index_t l = 0; l < p.layers; ++l) row.emplace_back(l < a ? 0.0 : sim[a * p.layers + l]);
    rows.emplace_back(std::move(row));
  }
  floe::io::json::object o{{"layers", static_cast<double>(p.layers)},
                           {"kv_heads", static_cast<double>(p.kv_heads)},
                           {"anchors", index_array(p.anchors())},
                           {"anchor_of", index_array(p.anchor_of)},
                           {"head_of", index_array(p.head_of)},
                           {"dense_layers", index_array(p.dense_layers)},
                           {"calibration", floe::io::json::object{{"text", source},
                                                                  {"steps", static_cast<double>(cal.steps())},
                                                                  {"fraction", fraction},
                                                                  {"layer_similarity", std::move(rows)}}}};
  return floe::io::json(std::move(o)).dump() + "\n";
}

inline floe::select::anchor_plan read_plan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  floe::require(in.good(), "anchor-plan", "cannot open '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  const auto j = floe::io::json::parse(text.str(), path);
  const auto number = [&](const char* key) {
    const auto* v = j.find(key);
    floe::require(v && v->is_number() && v->as_number() >= 0 && v->as_number() == std::floor(v->as_number()),
                  "anchor-plan", path, ": '", key, "' must be a non-negative integer");
    return static_cast<floe::index_t>(v->as_number());
  };
  const auto list = [&](const char* key) {
    const auto* v = j.find(key);
    floe::require(v && v->is_array(), "anchor-plan", path, ": '", key, "' must be an array");
    std::vector<floe::index_t> out;
    for (const auto& x : v->as_array()) {
      floe::require(x.is_number() && x.as_number() >= 0 && x.as_number() == std::floor(x.as_number()),
                    "anchor-plan", path, ": '", key, "' holds a non-integer");
      out.push_back(static_cast<floe::index_t>(x.as_number()));
    }
    return out;
  };
  floe::select::anchor_plan p{number("layers"), number("kv_heads"), list("anchor_of"), list("head_of"),
                              j.find("dense_layers") ? list("dense_layers") : std::vector<floe::index_t>{}};
  p.validate();
  return p;
}

// anchor_reuse+none on executor E from a plan: `same_heads` reads head h of the anchor for
// head h (the ablation of the head map). budget is the fraction of each head's prefill
// cache an anchor attends.
template <floe::Executor E>
std::unique_ptr<decode_attention> make_anchor_attention(floe::select::anchor_plan plan, bool same_heads,
                                                        double budget, const std::string& label) {
  if (same_heads)
    for (floe::index_t l = 0; l < plan.layers; ++l)
      for (floe::index_t h = 0; h < plan.kv_heads; ++h) plan.head_of[l * plan.kv_heads + h] = h;
  const floe::select::anchor_reuse proto{0, std::make_shared<floe::select::anchor_store>(plan)};
  using est = floe::estimator<floe::select::anchor_reuse, floe::residual::none>;
  return std::make_unique<estimator_attention<floe::any_estimator<E>, E>>(
      [proto, budget, label](int l, int g) {
        const auto slot = proto.at(static_cast<floe::index_t>(l), static_cast<floe::index_t>(g));
        return floe::any_estimator<E>::from(label, [slot, budget](floe::index_t n) {
          auto s = slot;
          s.k = floe::budget::fraction(budget).resolve(n);
          return est(s, {});
        });
      },
      label);
}

}  // namespace smollm
