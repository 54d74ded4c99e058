// The index of a policy that builds nothing at prefill.
#pragma once

#include <cstdint>

namespace floe {

struct no_index {
  std::uint64_t bytes() const { return 0; }
};

}  // namespace floe
