// The decode attention methods this example can run, by name: every configuration of
// the evaluation tool's registry (bench/eval/method_registry.hpp), type-erased as
// floe::any_estimator, on floe's SIMD executor or on the scalar reference.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "anchors.hpp"
#include "attention.hpp"
#include "floe/any_estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
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

// `budget` is the fraction of the cache, as it is after prefill, that a sparse method
// may read exactly (dense ignores it). `exec` is "simd" (one thread, the best
// instruction set of this CPU) or "scalar" (double accumulation, the reference).
// `plan` is the anchor plan the anchor_reuse methods need (null for the others).
inline std::unique_ptr<decode_attention> make_attention(const std::string& name, double budget,
                                                        const std::string& exec = "simd",
                                                        const floe::select::anchor_plan* plan = nullptr) {
  floe::require(budget > 0 && budget <= 1, "budget", "must be in (0, 1], got ", budget);
  floe::require(exec == "simd" || exec == "scalar", "exec", "unknown executor '", exec, "'; known: simd, scalar");
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
