// The argument a call's floe::invalid_argument names, or "(nothing thrown)": the bad-input
// tests' check that an error names the argument.
#pragma once

#include <string>

#include "floe/core/error.hpp"

namespace floe::testing {

template <class F>
std::string argument_of(F&& f) {
  try {
    f();
  } catch (const floe::invalid_argument& e) {
    return e.argument();
  }
  return "(nothing thrown)";
}

}  // namespace floe::testing
