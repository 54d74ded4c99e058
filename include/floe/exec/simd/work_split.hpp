// Host-side planning for the SIMD executor: cutting token ranges into pieces of nearly
// equal token counts (split-K over N).
#pragma once

#include <span>
#include <vector>

#include "floe/core/selection.hpp"

namespace floe::simd_detail {

// Cuts `ranges` (holding `tokens` tokens) into `parts` consecutive pieces whose token
// counts differ by at most one; a piece boundary may fall inside a range.
inline std::vector<std::vector<token_range>> split_ranges(std::span<const token_range> ranges, index_t tokens,
                                                          index_t parts) {
  std::vector<std::vector<token_range>> pieces(parts);
  index_t r = 0, offset = 0;  // position inside ranges[r]
  for (index_t p = 0; p < parts; ++p) {
    index_t want = tokens / parts + (p < tokens % parts ? 1 : 0);
    while (want > 0) {
      const token_range& x = ranges[r];
      const index_t take = want < x.size() - offset ? want : x.size() - offset;
      pieces[p].push_back({x.begin + offset, x.begin + offset + take});
      want -= take;
      offset += take;
      if (offset == x.size()) {
        ++r;
        offset = 0;
      }
    }
  }
  return pieces;
}

}  // namespace floe::simd_detail
