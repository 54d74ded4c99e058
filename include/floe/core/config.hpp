// Build-wide macros and small constants shared by every part of floe.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define FLOE_HOST_DEVICE __host__ __device__
#else
#define FLOE_HOST_DEVICE
#endif

#define FLOE_VERSION_MAJOR 0
#define FLOE_VERSION_MINOR 1
#define FLOE_VERSION_PATCH 0

namespace floe {
using index_t = std::size_t;  // token and dimension counts
}  // namespace floe
