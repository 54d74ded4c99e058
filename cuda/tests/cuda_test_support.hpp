// Helpers of the CUDA executor tests: KV caches and rows in pinned host memory (the
// device reads it through unified addressing, the host-side selectors read it too) and
// in device memory (cudaMalloc), the engine's case.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "floe/core/error.hpp"
#include "support/random_kv.hpp"

namespace floe::testing {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// The argument named by the floe::invalid_argument that f throws, when its message holds
// `text`; otherwise a line that says what came instead.
template <class F>
std::string refusal_of(F&& f, const std::string& text) {
  try {
    f();
  } catch (const floe::invalid_argument& e) {
    if (std::string(e.what()).find(text) != std::string::npos) return e.argument();
    return e.argument() + " (without \"" + text + "\": " + e.what() + ")";
  }
  return "(nothing thrown)";
}

// A copy of a host array in memory the device can address: pinned host or device.
template <class T>
class cuda_array {
 public:
  enum where { pinned_host, device };
  cuda_array(const std::vector<T>& host, where w) : n_(host.size()), w_(w) {
    const std::size_t bytes = n_ * sizeof(T) + 64;
    if (w_ == pinned_host) {
      cuda_check(cudaMallocHost(&p_, bytes), "cudaMallocHost");
      std::memcpy(p_, host.data(), n_ * sizeof(T));
    } else {
      cuda_check(cudaMalloc(&p_, bytes), "cudaMalloc");
      cuda_check(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "copy to device");
    }
  }
  ~cuda_array() { w_ == pinned_host ? (void)cudaFreeHost(p_) : (void)cudaFree(p_); }
  cuda_array(const cuda_array&) = delete;
  cuda_array& operator=(const cuda_array&) = delete;
  T* data() const { return p_; }
  std::vector<T> to_host() const {
    std::vector<T> out(n_);
    cuda_check(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDefault), "copy to host");
    return out;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
  where w_;
};

// random_kv's rows copied where the device reads them, with the same layout and views.
template <KvElement T>
struct cuda_kv {
  const random_kv<T>& host;
  cuda_array<T> keys, values;
  cuda_kv(const random_kv<T>& h, typename cuda_array<T>::where w) : host(h), keys(h.keys, w), values(h.values, w) {}
  kv_view<T> view() const { return {keys.data(), values.data(), host.n, host.d, host.dv, host.key_stride, host.value_stride}; }
  paged_kv_view<T> paged_view() const {
    return {keys.data(), values.data(), host.keys.size() / host.key_stride / host.block_size, host.block_size,
            host.table, host.n, host.d, host.dv, host.key_stride, host.value_stride};
  }
};

}  // namespace floe::testing
