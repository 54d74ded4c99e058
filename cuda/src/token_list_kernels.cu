// The check of device token lists (exec::cuda::decode_indexed): before any row is read
// through them, every index must lie inside its cache and follow the one before it.
#include <cuda_runtime.h>

#include "floe/exec/cuda/kernel_api.hpp"
#include "stream.cuh"

namespace floe::cuda_detail {
namespace {

// Blocks (x, list): a grid-stride share of one list's positions.
__global__ void check_tokens(const token_list* lists, unsigned long long* first) {
  const token_list l = lists[blockIdx.y];
  for (std::int64_t p = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; p < l.count;
       p += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t i = l.indices[p];
    if (i < 0 || i >= l.n || (p > 0 && i <= l.indices[p - 1]))
      atomicMin(first, (static_cast<unsigned long long>(blockIdx.y) << 32) | static_cast<unsigned long long>(p));
  }
}

}  // namespace

void launch_check_tokens(const token_list* lists, int list_count, unsigned long long* first) {
  if (list_count == 0) return;
  check_tokens<<<dim3(32, list_count), 256, 0, current_stream>>>(lists, first);
  check(cudaGetLastError(), "token check launch");
}

}  // namespace floe::cuda_detail
