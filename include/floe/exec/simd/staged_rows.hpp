// Short runs of rows (scattered single tokens of a Top-K, sampled or token-scan selection)
// copied into a small contiguous buffer before the kernel reads them. A plain copy loop
// keeps many line misses in flight; the kernel's demand loads of a scattered tile stall
// the prefetches of the next one behind them (docs/benchmarks.md, "Scattered rows staged").
// Chunks are whole tiles, so the kernel sees the same tiles, in the same order, as without.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "floe/exec/simd/kernel_api.hpp"

namespace floe::simd_detail {

// A batch is staged when its runs average fewer rows than this.
inline constexpr index_t staged_mean_run = 4;
// Bytes of one chunk of staged rows (keys and values): well inside L2.
inline constexpr index_t staged_chunk_bytes = 128 << 10;
// Rows a copy asks for ahead of the one it copies.
inline constexpr index_t staged_rows_ahead = 16;

// Asks for the lines of a row: Locality 3 (into L1) right before a copy, 2 (L2) for the
// driver's requests a batch ahead. The kernels have their own (attend_kernel.hpp: ODR).
template <int Locality, class T>
inline __attribute__((always_inline)) void prefetch_row(const T* row, index_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (index_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// 64 bytes at a time where it can (one vector move each, no library call per row).
template <class T>
inline __attribute__((always_inline)) void copy_row(T* to, const T* from, index_t bytes) {
  char* t = reinterpret_cast<char*>(to);
  const char* f = reinterpret_cast<const char*>(from);
  index_t b = 0;
  for (; b + 64 <= bytes; b += 64) __builtin_memcpy(t + b, f + b, 64);
  if (b < bytes) std::memcpy(t + b, f + b, static_cast<std::size_t>(bytes - b));
}

inline bool worth_staging(index_t runs, index_t tokens) { return runs > 0 && tokens < staged_mean_run * runs; }

// Folds `runs` (key_stride / value_stride of args apart inside a run) into `state` through
// the staging buffer; `after` as for typed_kernels::attend.
template <class T>
void attend_staged(const typed_kernels<T>& kernel, const group_args& args, const row_run<T>* runs, index_t count,
                   index_t tokens, const online_state& state, const row_run<const T*>& after) {
  const index_t d = args.d, dv = args.dv;
  const index_t row_elements = d + dv;
  const index_t chunk = std::max<index_t>(
      tile_tokens, staged_chunk_bytes / (row_elements * index_t{sizeof(T)}) / tile_tokens * tile_tokens);
  thread_local std::vector<const T*> row_pointers;  // the batch's key rows, then its value rows
  thread_local std::vector<T> stage;                // [chunk, d] keys, then [chunk, dv] values, from a line
  row_pointers.resize(2 * tokens);
  stage.resize(chunk * row_elements + 64 / sizeof(T));
  const T** const keys = row_pointers.data();
  const T** const values = keys + tokens;
  index_t n = 0;
  for (index_t r = 0; r < count; ++r)
    for (index_t i = 0; i < runs[r].count; ++i, ++n) {
      keys[n] = runs[r].keys + i * args.key_stride;
      values[n] = runs[r].values + i * args.value_stride;
    }
  // Rows off a 64-byte line cost the kernel ~40 % from L2 (docs/simd-executor.md, "Alignment").
  const auto misalignment = reinterpret_cast<std::uintptr_t>(stage.data()) % 64;
  T* const staged_keys = stage.data() + (misalignment ? (64 - misalignment) / sizeof(T) : 0);
  T* const staged_values = staged_keys + chunk * d;
  group_args staged = args;
  staged.key_stride = d;
  staged.value_stride = dv;
  const row_run<const T*> none{nullptr, nullptr, 0};
  const index_t key_bytes = d * index_t{sizeof(T)}, value_bytes = dv * index_t{sizeof(T)};
  for (index_t begin = 0; begin < tokens; begin += chunk) {
    const index_t m = std::min(chunk, tokens - begin);
    for (index_t i = 0; i < m; ++i) {
      if (const index_t a = begin + i + staged_rows_ahead; a < tokens) {
        prefetch_row<3>(keys[a], key_bytes);
        prefetch_row<3>(values[a], value_bytes);
      }
      copy_row(staged_keys + i * d, keys[begin + i], key_bytes);
      copy_row(staged_values + i * dv, values[begin + i], value_bytes);
    }
    const row_run<T> run{staged_keys, staged_values, m};
    kernel.attend(staged, &run, 1, state, begin + m == tokens ? after : none);
  }
}

}  // namespace floe::simd_detail
