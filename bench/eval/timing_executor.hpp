// The executor floe-eval runs and times every method on: the one place to switch it.
// The error reference is always exec::scalar in double, whatever this says.
// floe-eval already spreads KV heads over its own threads, so the SIMD executor runs
// serially inside each (no split-K): threads go to the tool, not to both.
#pragma once

#include "floe/exec/simd.hpp"

namespace floe::eval {

using timing_executor = floe::exec::simd;

inline timing_executor make_timing_executor() { return timing_executor{}; }

}  // namespace floe::eval
