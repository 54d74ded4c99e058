// Decode attention speed of floe::exec::cuda, dense, gathered (64-token ranges covering
// 5 % of N), paged (16-token blocks), an anchor step (Kascade's anchor layer, oracle_topk:
// every KV head's group_top_k of 5 % of N into device memory for the batch's device
// queries, then one decode_indexed of the chosen tokens; anchor_step_host_queries ranks
// for host queries, one call per sequence) and a reuse step (a later layer: decode_indexed over the anchor's
// device lists), as bytes read per second and as a fraction of the device's read
// bandwidth measured in the same run by a streaming-read kernel.
// Each iteration is one whole call (host planning, upload, kernels, synchronize), on KV
// copies rotated so that the working set is several times the L2 cache.
//
//   floe_cuda_decode_bench [--benchmark_format=json] [--benchmark_filter=...]
//   FLOE_CUDA_CHUNK=1024   tokens per thread block (cuda_options::chunk_tokens; default automatic)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "floe/exec/cuda.hpp"

namespace {

using floe::index_t;
using floe::token_range;

void check(cudaError_t e) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

// Read bandwidth: every 16-byte word of a buffer far larger than L2 read once.
__global__ void stream_read(const uint4* p, std::size_t words, unsigned* sink) {
  unsigned x = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < words; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // keeps the loads
}

double measured_read_gbps() {
  static const double gbps = [] {
    const std::size_t bytes = std::size_t(4) << 30, words = bytes / 16;
    uint4* p;
    unsigned* sink;
    check(cudaMalloc(&p, bytes));
    check(cudaMalloc(&sink, 4));
    check(cudaMemset(p, 1, bytes));
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ms;
    for (int rep = 0; rep < 7; ++rep) {
      cudaEventRecord(a);
      stream_read<<<sms * 8, 512>>>(p, words, sink);
      cudaEventRecord(b);
      check(cudaEventSynchronize(b));
      float t;
      cudaEventElapsedTime(&t, a, b);
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    cudaFree(p);
    cudaFree(sink);
    const double g = bytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
    std::fprintf(stderr, "floe: device read bandwidth %.0f GB/s (4 GiB streaming read, median of 7)\n", g);
    return g;
  }();
  return gbps;
}

// Distinct finite values, so that the anchor step ranks real scores: 16-bit patterns of
// magnitude 0.5-1 (fp16) or 0.5-2 (bf16) with a hashed mantissa and sign.
__global__ void fill_hashed(std::uint16_t* p, std::size_t count, std::uint16_t exponent_bits) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < count; i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = static_cast<std::uint16_t>(exponent_bits | (h & 0x83ffu));
  }
}

enum class access { dense, gathered, paged16, anchor, anchor_host_queries, reuse };

template <class T>
void decode_case(benchmark::State& state, access how, index_t d, index_t hq, index_t hkv) {
  const index_t n = static_cast<index_t>(state.range(0)), batch = static_cast<index_t>(state.range(1));
  const floe::gqa_shape shape{hq, hkv};
  const std::size_t heads = batch * hkv, head_elems = n * d;
  const std::size_t step_bytes = heads * head_elems * 2 * sizeof(T);
  const std::size_t copies = std::max<std::size_t>(1, (std::size_t(512) << 20) / step_bytes);
  T* kv;
  check(cudaMalloc(&kv, copies * step_bytes));
  check(cudaMemset(kv, 0x3c, copies * step_bytes));  // finite values (0x3c3c: 1.06 in fp16, 0.0115 in bf16)
  if (how == access::anchor || how == access::anchor_host_queries || how == access::reuse)
    fill_hashed<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(kv), copies * step_bytes / 2,
                               sizeof(T) == 2 && std::is_same_v<T, floe::half> ? 0x3800 : 0x3f00);
  float *q, *out;
  check(cudaMalloc(&q, batch * hq * d * sizeof(float)));
  check(cudaMalloc(&out, batch * hq * d * sizeof(float)));
  check(cudaMemset(q, 0, batch * hq * d * sizeof(float)));
  const index_t blocks = (n + 15) / 16;
  std::vector<std::int32_t> table(blocks);
  for (index_t b = 0; b < blocks; ++b) table[b] = static_cast<std::int32_t>(b);
  std::mt19937_64 g(7);
  std::shuffle(table.begin(), table.end(), g);
  // Per copy: the views of its heads; gathered selections are 64-token ranges at random
  // 64-aligned places, 5 % of N.
  std::vector<std::vector<floe::kv_view<T>>> views(copies * batch);
  std::vector<std::vector<floe::paged_kv_view<T>>> paged(copies * batch);
  for (std::size_t c = 0; c < copies; ++c)
    for (index_t s = 0; s < batch; ++s)
      for (index_t h = 0; h < hkv; ++h) {
        const T* base = kv + (c * heads + s * hkv + h) * head_elems * 2;
        views[c * batch + s].emplace_back(base, base + head_elems, n, d, d);
        paged[c * batch + s].emplace_back(base, base + head_elems, blocks, 16, table, n, d, d);
      }
  std::vector<std::vector<token_range>> exact(heads);
  const index_t ranges = std::max<index_t>(1, n / 20 / 64);
  for (auto& e : exact) {
    std::vector<index_t> starts(n / 64);
    for (index_t i = 0; i < starts.size(); ++i) starts[i] = i * 64;
    std::shuffle(starts.begin(), starts.end(), g);
    starts.resize(ranges);
    std::sort(starts.begin(), starts.end());
    for (index_t st : starts) e.push_back({st, st + 64});
  }
  const char* chunk = std::getenv("FLOE_CUDA_CHUNK");
  const floe::exec::cuda ex({0, chunk ? static_cast<index_t>(std::strtoull(chunk, nullptr, 10)) : 0});
  const float scale = 1.f / std::sqrt(float(d));
  index_t tokens = how == access::gathered ? ranges * 64 : n;
  // The anchor step's queries (host ones are staged by group_top_k) and its chosen tokens, kept
  // on the device per copy and head: an anchor step writes them, a reuse step reads them.
  std::vector<float> qh(batch * hq * d);
  for (float& x : qh) x = std::uniform_real_distribution<float>(-1.f, 1.f)(g);
  const index_t k = n / 20, group = hq / hkv;
  std::int32_t* chosen = nullptr;
  std::vector<floe::exec::device_tokens> lists(copies * heads);
  const bool ranks = how == access::anchor || how == access::anchor_host_queries || how == access::reuse;
  if (ranks) {
    check(cudaMalloc(&chosen, copies * heads * k * sizeof(std::int32_t)));
    for (std::size_t i = 0; i < lists.size(); ++i) lists[i] = {chosen + i * k, k};
    check(cudaMemcpy(q, qh.data(), qh.size() * sizeof(float), cudaMemcpyHostToDevice));  // the same queries on the device
  }
  auto seqs_of = [&](std::size_t copy) {
    std::vector<floe::sequence<floe::kv_view<T>>> seqs;
    for (index_t s = 0; s < batch; ++s) seqs.push_back({views[copy * batch + s], q + s * hq * d, out + s * hq * d});
    return seqs;
  };
  auto anchor_step = [&](std::size_t copy) {
    if (how != access::anchor_host_queries)  // one group_top_k call ranks every KV head of the batch
      ex.group_top_k<floe::kv_view<T>>(seqs_of(copy), shape, scale, k, chosen + copy * heads * k);
    else for (index_t s = 0; s < batch; ++s) {  // one group_top_k call per sequence
      std::vector<floe::query_group> qs;
      for (index_t h = 0; h < hkv; ++h) qs.push_back({qh.data() + (s * hq + h * group) * d, group, d, d, scale});
      ex.group_top_k(std::span<const floe::kv_view<T>>(views[copy * batch + s]), std::span<const floe::query_group>(qs), k,
                     chosen + (copy * heads + s * hkv) * k);
    }
    ex.decode_indexed<T>(seqs_of(copy), shape, scale, std::span(lists).subspan(copy * heads, heads));
  };
  if (how == access::reuse)
    for (std::size_t copy = 0; copy < copies; ++copy) anchor_step(copy);
  std::size_t c = 0;
  auto one = [&] {
    if (how == access::anchor || how == access::anchor_host_queries) {
      anchor_step(c);
    } else if (how == access::reuse) {
      ex.decode_indexed<T>(seqs_of(c), shape, scale, std::span(lists).subspan(c * heads, heads));
    } else if (how == access::paged16) {
      std::vector<floe::sequence<floe::paged_kv_view<T>>> seqs;
      for (index_t s = 0; s < batch; ++s) seqs.push_back({paged[c * batch + s], q + s * hq * d, out + s * hq * d});
      ex.decode<floe::paged_kv_view<T>>(seqs, shape, scale);
    } else {
      std::vector<floe::sequence<floe::kv_view<T>>> seqs;
      for (index_t s = 0; s < batch; ++s) seqs.push_back({views[c * batch + s], q + s * hq * d, out + s * hq * d});
      if (how == access::dense) ex.decode<floe::kv_view<T>>(seqs, shape, scale);
      else ex.decode_gathered<floe::kv_view<T>>(seqs, shape, scale, exact);
    }
    c = (c + 1) % copies;
  };
  one();  // warm-up: allocator pool, first launches
  for (auto _ : state) one();
  // The anchor step reads every key and the chosen tokens' values (their keys are
  // cached); the reuse step the chosen tokens' keys and values.
  const double bytes = how == access::anchor || how == access::anchor_host_queries ? double(heads) * (n + k) * d * sizeof(T)
                       : how == access::reuse ? double(heads) * k * d * 2 * sizeof(T)
                                              : double(heads) * tokens * d * 2 * sizeof(T);
  state.counters["bytes"] = bytes;
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["device_read_GB/s"] = measured_read_gbps();
  state.counters["bw_fraction"] = benchmark::Counter(bytes * 1e-9 / measured_read_gbps(), benchmark::Counter::kIsIterationInvariantRate);
  cudaFree(kv);
  cudaFree(chosen);
  cudaFree(q);
  cudaFree(out);
}

template <class... Parts>
std::string join(const Parts&... parts) {
  std::ostringstream o;
  (o << ... << parts);
  return o.str();
}

template <class T>
void register_type(const char* type) {
  struct shape {
    index_t d, hq, hkv;
  };
  for (shape s : {shape{128, 32, 8}, shape{64, 9, 3}})
    for (auto [how, label] : {std::pair{access::dense, "dense"}, {access::gathered, "gathered"}, {access::paged16, "paged16"},
                              {access::anchor, "anchor_step"}, {access::anchor_host_queries, "anchor_step_host_queries"},
                              {access::reuse, "reuse_step"}}) {
      auto* b = benchmark::RegisterBenchmark(join("cuda/", label, "/", type, "/d", s.d, "_hq", s.hq, "_hkv", s.hkv).c_str(),
                                             [=](benchmark::State& st) { decode_case<T>(st, how, s.d, s.hq, s.hkv); });
      b->ArgNames({"N", "batch"})->UseRealTime()->Unit(benchmark::kMicrosecond);
      for (std::int64_t n : {4096, 32768, 131072})
        for (std::int64_t batch : {1, 8}) b->Args({n, batch});
    }
}

// A whole decode step of a 30-layer model (d 128, Hq 32, Hkv 8, fp16, batch 1, its own
// KV per layer): dense in every layer (anchors 0), or Kascade with layer 0 dense, the
// anchors of SmolLM2's calibrated plans (8: 1 2 3 14 17 20 21 28; 3: 1 3 21) ranking 5 %
// of N with group_top_k into device memory (for the device queries; host_queries:1, for
// a host copy of them), and every other layer reusing its latest anchor's lists (same KV
// head) through decode_indexed.
void model_step_case(benchmark::State& state) {
  using T = floe::half;
  const index_t n = static_cast<index_t>(state.range(0)), anchors = static_cast<index_t>(state.range(1));
  const bool host_queries = state.range(2) != 0;
  constexpr index_t layers = 30, d = 128, hq = 32, hkv = 8, group = hq / hkv;
  const floe::gqa_shape shape{hq, hkv};
  const std::size_t head_elems = n * d, layer_elems = hkv * head_elems * 2;
  T* kv;
  check(cudaMalloc(&kv, layers * layer_elems * sizeof(T)));
  fill_hashed<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(kv), layers * layer_elems, 0x3800);
  std::vector<std::vector<floe::kv_view<T>>> views(layers);
  for (index_t l = 0; l < layers; ++l)
    for (index_t h = 0; h < hkv; ++h) {
      const T* base = kv + l * layer_elems + h * head_elems * 2;
      views[l].emplace_back(base, base + head_elems, n, d, d);
    }
  float *q, *out;
  check(cudaMalloc(&q, hq * d * sizeof(float)));
  check(cudaMalloc(&out, hq * d * sizeof(float)));
  std::vector<float> qh(hq * d);
  std::mt19937_64 g(11);
  for (float& x : qh) x = std::uniform_real_distribution<float>(-1.f, 1.f)(g);
  check(cudaMemcpy(q, qh.data(), qh.size() * sizeof(float), cudaMemcpyHostToDevice));
  const float scale = 1.f / std::sqrt(float(d));
  std::vector<floe::query_group> qs;
  for (index_t h = 0; h < hkv; ++h) qs.push_back({qh.data() + h * group * d, group, d, d, scale});
  std::vector<char> is_anchor(layers, 0);
  const std::vector<index_t> plan8{1, 2, 3, 14, 17, 20, 21, 28}, plan3{1, 3, 21};
  for (index_t l : anchors == 8 ? plan8 : anchors == 3 ? plan3 : std::vector<index_t>{}) is_anchor[l] = 1;
  const index_t k = n / 20;
  std::int32_t* chosen;
  check(cudaMalloc(&chosen, layers * hkv * k * sizeof(std::int32_t)));
  std::vector<std::vector<floe::exec::device_tokens>> lists(layers);
  for (index_t l = 0; l < layers; ++l)
    for (index_t h = 0; h < hkv; ++h) lists[l].push_back({chosen + (l * hkv + h) * k, k});
  const floe::exec::cuda ex;
  auto step = [&] {
    index_t latest = 0;  // the anchor a reuse layer reads
    for (index_t l = 0; l < layers; ++l) {
      const std::vector<floe::sequence<floe::kv_view<T>>> seqs{{views[l], q, out}};
      if (l == 0 || anchors == 0) {
        ex.decode<floe::kv_view<T>>(seqs, shape, scale);
        continue;
      }
      if (is_anchor[l]) {
        latest = l;
        if (host_queries)
          ex.group_top_k(std::span<const floe::kv_view<T>>(views[l]), std::span<const floe::query_group>(qs), k,
                         chosen + l * hkv * k);
        else
          ex.group_top_k<floe::kv_view<T>>(seqs, shape, scale, k, chosen + l * hkv * k);
      }
      ex.decode_indexed<T>(seqs, shape, scale, lists[latest]);
    }
  };
  step();  // warm-up
  for (auto _ : state) step();
  state.counters["layers"] = layers;
  state.counters["anchors"] = double(anchors);
  cudaFree(kv);
  cudaFree(chosen);
  cudaFree(q);
  cudaFree(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (!floe::exec::cuda::available()) {
    std::fprintf(stderr, "floe: no CUDA device; nothing to measure\n");
    return 1;
  }
  register_type<floe::half>("f16");
  benchmark::RegisterBenchmark("cuda/model_step/f16/d128_hq32_hkv8/layers30", model_step_case)
      ->ArgNames({"N", "anchors", "host_queries"})
      ->ArgsProduct({{32768, 131072}, {0, 8, 3}, {0}})
      ->ArgsProduct({{32768, 131072}, {8, 3}, {1}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  register_type<floe::bfloat16>("bf16");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  measured_read_gbps();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
