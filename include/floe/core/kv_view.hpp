// Non-owning views of one (layer, KV head) of a KV cache in memory the caller owns:
// contiguous rows with a stride, or pages addressed through a block table.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/numeric_types.hpp"

namespace floe {

// Keys [n, d] and values [n, dv], row-major; strides count elements between rows.
template <KvElement T>
class kv_view {
 public:
  using element_type = T;

  kv_view(const T* keys, const T* values, index_t n, index_t d, index_t dv, index_t key_stride = 0,
          index_t value_stride = 0)
      : keys_(keys), values_(values), n_(n), d_(d), dv_(dv),
        key_stride_(key_stride ? key_stride : d), value_stride_(value_stride ? value_stride : dv) {
    require(n > 0, "n", "the KV cache is empty (n = 0)");
    require(d > 0, "d", "key dimension must be positive");
    require(dv > 0, "dv", "value dimension must be positive");
    require(keys != nullptr, "keys", "null pointer with n = ", n);
    require(values != nullptr, "values", "null pointer with n = ", n);
    require(key_stride_ >= d, "keys.row_stride", "stride ", key_stride_, " is smaller than the row length d = ", d);
    require(value_stride_ >= dv, "values.row_stride", "stride ", value_stride_, " is smaller than the row length dv = ", dv);
  }

  index_t n() const { return n_; }
  index_t d() const { return d_; }
  index_t dv() const { return dv_; }
  index_t key_stride() const { return key_stride_; }
  index_t value_stride() const { return value_stride_; }
  const T* key_row(index_t i) const { return keys_ + i * key_stride_; }
  const T* value_row(index_t i) const { return values_ + i * value_stride_; }

  // Calls f(first_token, count, key_rows, value_rows) for maximal runs of rows that are
  // evenly strided in memory; [begin, end) is one run here.
  template <class F>
  void for_each_run(index_t begin, index_t end, F&& f) const {
    if (begin < end) f(begin, end - begin, key_row(begin), value_row(begin));
  }

 private:
  const T* keys_;
  const T* values_;
  index_t n_, d_, dv_, key_stride_, value_stride_;
};

// Paged cache: pools of fixed-size blocks, block b holding tokens in rows
// [b*block_size, (b+1)*block_size) of the pool; token i of the sequence lives in pool
// block block_table[i / block_size], row i % block_size.
template <KvElement T>
class paged_kv_view {
 public:
  using element_type = T;

  paged_kv_view(const T* key_pool, const T* value_pool, index_t pool_blocks, index_t block_size,
                std::span<const std::int32_t> block_table, index_t n, index_t d, index_t dv,
                index_t key_stride = 0, index_t value_stride = 0)
      : keys_(key_pool), values_(value_pool), pool_blocks_(pool_blocks), block_size_(block_size),
        table_(block_table), n_(n), d_(d), dv_(dv), key_stride_(key_stride ? key_stride : d),
        value_stride_(value_stride ? value_stride : dv) {
    require(n > 0, "n", "the KV cache is empty (n = 0)");
    require(d > 0, "d", "key dimension must be positive");
    require(dv > 0, "dv", "value dimension must be positive");
    require(block_size > 0, "block_size", "must be positive");
    require(key_pool != nullptr, "keys", "null pointer with n = ", n);
    require(value_pool != nullptr, "values", "null pointer with n = ", n);
    require(key_stride_ >= d, "keys.row_stride", "stride ", key_stride_, " is smaller than the row length d = ", d);
    require(value_stride_ >= dv, "values.row_stride", "stride ", value_stride_, " is smaller than the row length dv = ", dv);
    const index_t needed = (n + block_size - 1) / block_size;
    require(table_.size() >= needed, "block_table", "has ", table_.size(), " entries, ", needed,
            " needed for n = ", n, " tokens in blocks of ", block_size);
    for (index_t b = 0; b < needed; ++b)
      require(table_[b] >= 0 && static_cast<index_t>(table_[b]) < pool_blocks, "block_table",
              "entry ", b, " = ", table_[b], " is outside the pool of ", pool_blocks, " blocks");
  }

  index_t n() const { return n_; }
  index_t d() const { return d_; }
  index_t dv() const { return dv_; }
  index_t key_stride() const { return key_stride_; }
  index_t value_stride() const { return value_stride_; }
  index_t block_size() const { return block_size_; }
  index_t pool_blocks() const { return pool_blocks_; }
  const T* key_pool() const { return keys_; }
  const T* value_pool() const { return values_; }
  std::span<const std::int32_t> block_table() const { return table_; }
  const T* key_row(index_t i) const { return keys_ + pool_row(i) * key_stride_; }
  const T* value_row(index_t i) const { return values_ + pool_row(i) * value_stride_; }

  // Runs split at block boundaries: inside a block rows are evenly strided.
  template <class F>
  void for_each_run(index_t begin, index_t end, F&& f) const {
    while (begin < end) {
      const index_t stop = std::min(end, (begin / block_size_ + 1) * block_size_);
      f(begin, stop - begin, key_row(begin), value_row(begin));
      begin = stop;
    }
  }

 private:
  index_t pool_row(index_t i) const {
    return static_cast<index_t>(table_[i / block_size_]) * block_size_ + i % block_size_;
  }
  const T* keys_;
  const T* values_;
  index_t pool_blocks_, block_size_;
  std::span<const std::int32_t> table_;
  index_t n_, d_, dv_, key_stride_, value_stride_;
};

// What executors and policies need of a KV view; both layouts above satisfy it.
template <class V>
concept KvView = KvElement<typename V::element_type> && requires(const V& v, index_t i) {
  { v.n() } -> std::convertible_to<index_t>;
  { v.d() } -> std::convertible_to<index_t>;
  { v.dv() } -> std::convertible_to<index_t>;
  { v.key_stride() } -> std::convertible_to<index_t>;
  { v.value_stride() } -> std::convertible_to<index_t>;
  { v.key_row(i) } -> std::same_as<const typename V::element_type*>;
  { v.value_row(i) } -> std::same_as<const typename V::element_type*>;
};

// An index or summary over the first `covered` tokens refuses a view cut back below
// them ("kv"): what it summed is no longer in the cache.
inline void require_view_covers(index_t held, index_t covered, const char* what) {
  require(held >= covered, "kv", "the view holds ", held, " tokens, fewer than the ", covered, " ", what, " covers");
}

}  // namespace floe
