// The seam between floe's header-only SIMD driver and the per-architecture kernels that
// the floe::simd library compiles once per instruction set (docs/simd-executor.md).
// Plain structs of pointers and strides, so the driver needs no SIMD flags itself.
#pragma once

#include "floe/core/config.hpp"
#include "floe/core/numeric_types.hpp"

namespace floe {

// Instruction sets floe::simd can be built for; `automatic` resolves at run time.
enum class simd_arch { automatic, scalar, avx2, avx512 };

}  // namespace floe

namespace floe::simd_detail {

// Tokens a kernel scores and weights in one step; a multiple of every vector width.
inline constexpr index_t tile_tokens = 64;

// One GQA group: `heads` query rows against one KV head.
struct group_args {
  const float* q = nullptr;  // [heads, d], row stride q_stride
  index_t q_stride = 0;
  index_t heads = 1;
  index_t d = 0;
  index_t dv = 0;
  float scale = 1.f;
  index_t key_stride = 0;    // elements between consecutive rows inside a run
  index_t value_stride = 0;
};

// `count` rows that are evenly strided in memory (the strides of group_args).
template <class T>
struct row_run {
  const T* keys = nullptr;
  const T* values = nullptr;
  index_t count = 0;
};

// Online-softmax state of a group, in caller memory: m[heads], l[heads], a[heads * dv],
// and scratch[heads * (scratch_per_head + d)] that the kernel may overwrite.
struct online_state {
  float* m = nullptr;
  float* l = nullptr;
  float* a = nullptr;
  float* scratch = nullptr;
};
inline constexpr index_t scratch_per_head = tile_tokens + 1;  // plus d: a reordered copy of the query

template <class T>
struct typed_kernels {
  // Folds the rows of `runs` into `state`, exactly as if they came after what it holds.
  // `after` (may be empty) lists rows the caller reads next, e.g. the first tile of its
  // next task: the last tile prefetches them as it would its own next tile.
  void (*attend)(const group_args&, const row_run<T>* runs, index_t run_count, const online_state& state,
                 const row_run<const T*>& after) = nullptr;
  // z[i] = scale * q_head . k_i for the rows of `runs` in order.
  void (*score)(const group_args&, index_t head, const row_run<T>* runs, index_t run_count, float* z) = nullptr;
  // z[h * ld + i] = scale * q_h . k_i for every head h, each row read once.
  void (*score_group)(const group_args&, const row_run<T>* runs, index_t run_count, float* z, index_t ld) = nullptr;
};

struct kernel_set {
  simd_arch target = simd_arch::scalar;
  typed_kernels<float> f32;
  typed_kernels<half> f16;
  typed_kernels<bfloat16> bf16;

  template <KvElement T>
  const typed_kernels<T>& of() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, half>) return f16;
    else return bf16;
  }
};

// The kernels compiled into floe::simd for `target`, or nullptr when that target was not
// built (defined in the library; link floe::simd).
const kernel_set* compiled_kernels(simd_arch target) noexcept;

}  // namespace floe::simd_detail
