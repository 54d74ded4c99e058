// The executor floe-eval runs and times every method on: the one place to switch it.
// The error reference is always exec::scalar in double, whatever this says.
#pragma once

#include "floe/exec/scalar.hpp"

namespace floe::eval {

using timing_executor = floe::exec::scalar;

inline timing_executor make_timing_executor() { return {}; }

}  // namespace floe::eval
