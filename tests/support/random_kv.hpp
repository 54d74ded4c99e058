// Test support: a per-process random seed (fresh each run, printed, overridable with
// FLOE_SEED) and random KV caches in any element type and layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/numeric_types.hpp"

namespace floe::testing {

// The seed of this process: FLOE_SEED if set, else fresh from std::random_device.
// Printed once to stderr; tests also INFO() it so a failure shows how to replay it.
inline std::uint64_t seed() {
  static const std::uint64_t s = [] {
    std::uint64_t v;
    if (const char* env = std::getenv("FLOE_SEED")) v = std::strtoull(env, nullptr, 10);
    else v = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::fprintf(stderr, "floe test seed: FLOE_SEED=%llu\n", static_cast<unsigned long long>(v));
    return v;
  }();
  return s;
}

// A generator for one test case: the process seed mixed with a case-local salt.
inline std::mt19937_64 rng(std::uint64_t salt = 0) { return std::mt19937_64(seed() ^ (salt * 0x9e3779b97f4a7c15ull)); }

template <KvElement T>
std::vector<T> random_elements(std::mt19937_64& g, std::size_t count, float sigma = 1.f) {
  std::normal_distribution<float> normal(0.f, sigma);
  std::vector<T> out(count);
  for (auto& x : out) x = from_float<T>(normal(g));
  return out;
}

inline std::vector<float> random_floats(std::mt19937_64& g, std::size_t count, float sigma = 1.f) {
  return random_elements<float>(g, count, sigma);
}

// Storage for one KV head, contiguous or paged (blocks shuffled in a larger pool, with
// row strides larger than the row when asked), plus the view onto it.
template <KvElement T>
struct random_kv {
  index_t n, d, dv, key_stride, value_stride, block_size;
  std::vector<T> keys, values;        // contiguous rows, or the block pool when paged
  std::vector<std::int32_t> table;    // block table when paged

  random_kv(std::mt19937_64& g, index_t n_, index_t d_, index_t dv_, index_t pad = 0, index_t block = 0,
            float key_sigma = 1.f)
      : n(n_), d(d_), dv(dv_), key_stride(d_ + pad), value_stride(dv_ + pad), block_size(block) {
    index_t rows = n;
    if (block) {
      const index_t blocks = (n + block - 1) / block;
      const index_t pool = blocks + 3;  // spare blocks the table never names
      rows = pool * block;
      table.resize(blocks);
      std::vector<std::int32_t> ids(pool);
      for (index_t b = 0; b < pool; ++b) ids[b] = static_cast<std::int32_t>(b);
      std::shuffle(ids.begin(), ids.end(), g);
      for (index_t b = 0; b < blocks; ++b) table[b] = ids[b];
    }
    keys = random_elements<T>(g, rows * key_stride, key_sigma);
    values = random_elements<T>(g, rows * value_stride);
  }

  bool paged() const { return block_size != 0; }
  kv_view<T> view() const { return {keys.data(), values.data(), n, d, dv, key_stride, value_stride}; }
  paged_kv_view<T> paged_view() const {
    return {keys.data(), values.data(), keys.size() / key_stride / block_size, block_size, table, n, d, dv,
            key_stride, value_stride};
  }
};

}  // namespace floe::testing
