// The decode attention methods this example can run, by name. Until the evaluation
// tool's method registry lands, the configurations are listed here.
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "attention.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/streaming.hpp"

namespace smollm {

using decode_exec = floe::exec::scalar;

// `budget` is the fraction of the prefill context `ctx` a sparse method may read exactly.
inline std::unique_ptr<decode_attention> make_attention(const std::string& name, double budget, int ctx) {
  floe::require(budget > 0 && budget <= 1, "budget", "must be in (0, 1], got ", budget);
  const auto tokens = std::max<floe::index_t>(8, static_cast<floe::index_t>(budget * ctx));
  if (name == "dense")
    return std::make_unique<estimator_attention<floe::estimator<floe::select::dense, floe::residual::none>,
                                                decode_exec>>(
        floe::estimator<floe::select::dense, floe::residual::none>{});
  if (name == "streaming")
    return std::make_unique<estimator_attention<floe::estimator<floe::select::streaming, floe::residual::none>,
                                                decode_exec>>(
        floe::estimator<floe::select::streaming, floe::residual::none>(floe::select::streaming::with_budget(tokens),
                                                                       {}),
        "streaming(sink 4, window " + std::to_string(tokens - 4) + ")");
  floe::require(false, "attn", "unknown method '", name, "'; known: dense, streaming");
  return nullptr;
}

}  // namespace smollm
