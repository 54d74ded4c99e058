// The decode attention methods this example can run, by name: every configuration of
// the evaluation tool's registry (bench/eval/method_registry.hpp), type-erased as
// floe::any_estimator, on floe's SIMD executor or on the scalar reference.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "anchors.hpp"
#include "attention.hpp"
#include "floe/any_estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/select/mog_clusters.hpp"
#include "method_registry.hpp"

namespace smollm {

template <floe::Executor E>
const std::vector<floe::eval::method_entry<E>>& decode_methods() {
  static const auto methods = floe::eval::registered_methods<E>();
  return methods;
}

template <floe::Executor E>
std::unique_ptr<decode_attention> make_attention_on(const std::string& name, double budget) {
  const auto& entry = floe::eval::find_method(decode_methods<E>(), name, "attn");
  return std::make_unique<estimator_attention<floe::any_estimator<E>, E>>(
      entry.make(floe::budget::fraction(budget)), name);
}

// The names make_attention takes besides the registry's: anchor_reuse from --anchor-plan.
inline bool is_anchor_method(const std::string& name) {
  return name == "anchor_reuse+none" || name == "anchor_reuse:same_heads+none";
}

// mog:sample: mog whose index of each (layer, KV head) is built with the last prefill
// queries of that layer's GQA group as mog_config::query_sample (outliers by the sample's
// attention, docs/log/mog.md "Outliers chosen by a query sample"). The registry's methods
// see no queries, so this one lives here; `recent` is read when build() runs, after prefill.
template <floe::Executor E>
std::unique_ptr<decode_attention> make_sampled_mog(const recent_queries& recent, int group, int head_dim, double budget,
                                                   const std::string& label,
                                                   std::optional<floe::mog_config::scan_code> token_scan) {
  using est = floe::estimator<floe::select::mog_clusters, floe::residual::gaussian_moments>;
  return std::make_unique<estimator_attention<floe::any_estimator<E>, E>>(
      [&recent, group, head_dim, budget, label, token_scan](int l, int g) {
        floe::require(static_cast<std::size_t>(l) < recent.layer.size(), "attn", label,
                      " needs the prefill's queries (none kept for layer ", l, ")");
        const matrix& q = recent.layer[static_cast<std::size_t>(l)];
        std::vector<float> sample;  // rows of head_dim floats: every query head of group g at every kept position
        for (Eigen::Index r = 0; r < q.rows(); ++r)
          for (int h = g * group; h < (g + 1) * group; ++h)
            sample.insert(sample.end(), q.row(r).data() + h * head_dim, q.row(r).data() + (h + 1) * head_dim);
        return floe::any_estimator<E>::from(label, [sample = std::move(sample), budget, token_scan](floe::index_t n) {
          auto s = floe::select::mog_clusters::with_budget(floe::budget::fraction(budget), n);
          if (token_scan) s = s.with_token_scan(*token_scan);
          s.config.query_sample = sample;
          return est(s, {});
        });
      },
      label);
}

// `budget` is the fraction of the cache, as it is after prefill, that a sparse method
// may read exactly (dense ignores it). `exec` is "simd" (one thread, the best
// instruction set of this CPU) or "scalar" (double accumulation, the reference).
// `plan` is the anchor plan the anchor_reuse methods need (null for the others).
// `recent` holds the prefill's last queries per layer, which mog:sample[:token_scan[2]] needs (with the
// model's `group` query heads per KV head of `head_dim`).
inline std::unique_ptr<decode_attention> make_attention(const std::string& name, double budget,
                                                        const std::string& exec = "simd",
                                                        const floe::select::anchor_plan* plan = nullptr,
                                                        const recent_queries* recent = nullptr, int group = 1,
                                                        int head_dim = 0) {
  floe::require(budget > 0 && budget <= 1, "budget", "must be in (0, 1], got ", budget);
  floe::require(exec == "simd" || exec == "scalar", "exec", "unknown executor '", exec, "'; known: simd, scalar");
  if (name == "mog:sample" || name == "mog:sample:token_scan" || name == "mog:sample:token_scan2") {
    floe::require(recent != nullptr && head_dim > 0, "attn", name, " needs the prefill's queries (--perplexity only)");
    using code = floe::mog_config::scan_code;
    const auto scan = name == "mog:sample" ? std::nullopt
                      : std::optional<code>(name.ends_with("2") ? code::residual_2bit : code::keys_4bit);
    if (exec == "simd") return make_sampled_mog<floe::exec::simd>(*recent, group, head_dim, budget, name, scan);
    return make_sampled_mog<floe::exec::scalar>(*recent, group, head_dim, budget, name, scan);
  }
  if (is_anchor_method(name)) {
    floe::require(plan != nullptr, "anchor-plan", name, " needs --anchor-plan FILE (from --calibrate-anchors)");
    const bool same = name == "anchor_reuse:same_heads+none";
    if (exec == "simd") return make_anchor_attention<floe::exec::simd>(*plan, same, budget, name);
    return make_anchor_attention<floe::exec::scalar>(*plan, same, budget, name);
  }
  if (exec == "simd") return make_attention_on<floe::exec::simd>(name, budget);
  return make_attention_on<floe::exec::scalar>(name, budget);
}

}  // namespace smollm
