// The exact set E of an estimator: sorted, disjoint token ranges [begin, end).
#pragma once

#include <span>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"

namespace floe {

struct token_range {
  index_t begin = 0;
  index_t end = 0;
  index_t size() const { return end - begin; }
  friend bool operator==(const token_range&, const token_range&) = default;
};

// Base of every selector's result. Selectors derive from it to pass hints to their
// residual (uncovered clusters, inclusion probabilities, ...).
struct selection {
  std::vector<token_range> ranges;
  // True when the selector already read (and counted) the keys of the exact set while
  // choosing it, so the exact part counts only its values.
  bool keys_counted = false;

  void clear() { ranges.clear(); keys_counted = false; }

  // Appends [begin, end), joining it to the last range when they touch. Ranges must come
  // in increasing order.
  void add(index_t begin, index_t end) {
    if (begin >= end) return;
    if (!ranges.empty() && ranges.back().end == begin) ranges.back().end = end;
    else ranges.push_back({begin, end});
  }

  index_t count() const {
    index_t c = 0;
    for (const auto& r : ranges) c += r.size();
    return c;
  }
};

// Builds sorted disjoint ranges from token indices in increasing order.
template <class Indices>
void add_sorted_indices(selection& sel, const Indices& sorted) {
  for (index_t i : sorted) sel.add(i, i + 1);
}

// Rejects ranges that are unsorted, overlapping or reach past n (executors never read
// outside the cache); returns the number of tokens they cover.
inline index_t checked_token_count(std::span<const token_range> ranges, index_t n) {
  index_t prev_end = 0, tokens = 0;
  for (index_t r = 0; r < ranges.size(); ++r) {
    const auto& x = ranges[r];
    require(x.begin < x.end, "selection", "range ", r, " [", x.begin, ", ", x.end, ") is empty or reversed");
    require(r == 0 || x.begin >= prev_end, "selection", "range ", r, " starts at ", x.begin,
            " before the previous range ends at ", prev_end);
    require(x.end <= n, "selection", "range ", r, " ends at ", x.end, " past n = ", n);
    prev_end = x.end;
    tokens += x.size();
  }
  return tokens;
}

inline void validate_ranges(const std::vector<token_range>& ranges, index_t n) { checked_token_count(ranges, n); }

}  // namespace floe
