// Builds against an installed floe::cuda as a plain C++ program; with a GPU, checks one
// attend against the scalar reference, without one reports that it only linked.
#include <cuda_runtime.h>
#include <floe/exec/cuda.hpp>
#include <floe/floe.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  if (!floe::exec::cuda::available()) return std::printf("floe consumer (cuda): linked; no device to run on\n"), 0;
  const std::size_t n = 1000, d = 64;
  std::vector<float> k(n * d), v(n * d), q(d, 0.1f);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * static_cast<float>(i));
    v[i] = std::cos(0.11f * static_cast<float>(i));
  }
  float *dk = nullptr, *dv = nullptr;
  if (cudaMalloc(&dk, k.size() * sizeof(float)) != cudaSuccess || cudaMalloc(&dv, v.size() * sizeof(float)) != cudaSuccess)
    return std::printf("floe consumer (cuda): cudaMalloc failed\n"), 1;
  cudaMemcpy(dk, k.data(), k.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice);
  const auto group = floe::query_group::make(q.data(), 1, d);
  const std::vector<floe::token_range> all{{0, n}};
  floe::partial_set<float> got(1, d);
  floe::partial_set<double> want(1, d);
  floe::exec::cuda{}.attend(floe::kv_view<float>(dk, dv, n, d, d), group, all, got);
  floe::exec::scalar{}.attend(floe::kv_view<float>(k.data(), v.data(), n, d, d), group, all, want);
  std::vector<float> out(d), ref(d);
  got.finalize(floe::output_group<float>{out.data(), 1, d, 0});
  want.finalize(floe::output_group<float>{ref.data(), 1, d, 0});
  cudaFree(dk);
  cudaFree(dv);
  for (std::size_t j = 0; j < d; ++j)
    if (std::fabs(out[j] - ref[j]) > 1e-5f * (1.f + std::fabs(ref[j]))) return std::printf("mismatch at %zu\n", j), 1;
  std::printf("floe consumer (cuda): ok\n");
  return 0;
}
