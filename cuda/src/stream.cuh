// What the kernel files of floe::cuda share: the calling thread's stream and the error check.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "floe/exec/cuda/kernel_api.hpp"

namespace floe::cuda_detail {

// The stream of the calling thread's current executor call (select_device sets it).
inline thread_local cudaStream_t current_stream = cudaStreamPerThread;
inline thread_local int current_device = 0;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace floe::cuda_detail
