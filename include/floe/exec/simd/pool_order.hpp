// Visiting a paged view's blocks in pool order: attention over a set of tokens does not
// depend on the order they are read in (online softmax), while memory does: whole blocks
// of a shuffled block table read in increasing pool address stream like a contiguous
// cache (docs/benchmarks.md, "Paged blocks in pool order").
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "floe/core/selection.hpp"

namespace floe::simd_detail {

// Calls emit(token_range) for every piece of `ranges` in `kv` (a paged view) that lies in
// one block: pieces shorter than a block first, then the whole blocks in increasing pool
// index. Keeps the ranges' order for the whole blocks when it is that order already, when
// the table repeats a block among them, or when their pool indices spread over more than
// 64 times their count (a bitmap would cost more than it saves).
template <class KV, class Emit>
void for_blocks_in_pool_order(const KV& kv, std::span<const token_range> ranges, Emit&& emit) {
  const index_t bs = kv.block_size();
  const std::span<const std::int32_t> table = kv.block_table();
  thread_local std::vector<index_t> whole;  // logical block numbers
  thread_local std::vector<std::uint64_t> seen;
  whole.clear();
  for (const token_range& r : ranges)
    for (index_t i = r.begin; i < r.end;) {
      const index_t block = i / bs, stop = std::min(r.end, (block + 1) * bs);
      if (i == block * bs && stop == (block + 1) * bs) whole.push_back(block);
      else emit(token_range{i, stop});
      i = stop;
    }
  const auto in_given_order = [&] {
    for (index_t b : whole) emit(token_range{b * bs, (b + 1) * bs});
  };
  if (whole.size() < 2) return in_given_order();
  index_t first = static_cast<index_t>(table[whole[0]]), last = first;
  bool increasing = true;  // already in pool order (an in-order table, or a part of a split)
  for (index_t i = 1; i < whole.size(); ++i) {
    const index_t at = static_cast<index_t>(table[whole[i]]);
    increasing = increasing && at > static_cast<index_t>(table[whole[i - 1]]);
    first = std::min(first, at);
    last = std::max(last, at);
  }
  const index_t span = last - first + 1;
  if (increasing || span > 64 * whole.size()) return in_given_order();
  // Pool slot -> logical block: a bitmap of the slots in use, and each slot's block.
  thread_local std::vector<index_t> block_at;
  seen.assign(span / 64 + 1, 0);
  block_at.resize(span);
  for (index_t b : whole) {
    const index_t at = static_cast<index_t>(table[b]) - first;
    const std::uint64_t bit = std::uint64_t{1} << (at % 64);
    if (seen[at / 64] & bit) return in_given_order();  // a block listed twice: read it twice
    seen[at / 64] |= bit;
    block_at[at] = b;
  }
  for (index_t w = 0; w < seen.size(); ++w)
    for (std::uint64_t bits = seen[w]; bits != 0; bits &= bits - 1) {
      const index_t b = block_at[w * 64 + std::countr_zero(bits)];
      emit(token_range{b * bs, (b + 1) * bs});
    }
}

// `ranges` as pieces in pool order (above), for cutting into split-K parts: each part then
// reads a stretch of the pool rather than a scattered share of it.
template <class KV>
std::vector<token_range> ranges_in_pool_order(const KV& kv, std::span<const token_range> ranges) {
  std::vector<token_range> out;
  for_blocks_in_pool_order(kv, ranges, [&](token_range r) { out.push_back(r); });
  return out;
}

}  // namespace floe::simd_detail
