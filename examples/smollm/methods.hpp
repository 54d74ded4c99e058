// The decode attention methods this example can run, by name: every configuration of
// the evaluation tool's registry (bench/eval/method_registry.hpp), type-erased as
// floe::any_estimator on this example's executor.
#pragma once

#include <memory>
#include <string>

#include "attention.hpp"
#include "floe/any_estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "method_registry.hpp"

namespace smollm {

using decode_exec = floe::exec::scalar;

inline const std::vector<floe::eval::method_entry<decode_exec>>& decode_methods() {
  static const auto methods = floe::eval::registered_methods<decode_exec>();
  return methods;
}

// `budget` is the fraction of the cache, as it is after prefill, that a sparse method
// may read exactly; dense ignores it.
inline std::unique_ptr<decode_attention> make_attention(const std::string& name, double budget) {
  floe::require(budget > 0 && budget <= 1, "budget", "must be in (0, 1], got ", budget);
  const auto& entry = floe::eval::find_method(decode_methods(), name, "attn");
  return std::make_unique<estimator_attention<floe::any_estimator<decode_exec>, decode_exec>>(
      entry.make(floe::budget::fraction(budget)), name);
}

}  // namespace smollm
