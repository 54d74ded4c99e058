// Selector `streaming`: sink tokens [0, S) and the recent window [n - W, n), as
// StreamingLLM / DuoAttention's streaming heads. docs/methods/streaming.md.
#pragma once

#include <algorithm>
#include <string_view>

#include "floe/core/budget.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"

namespace floe::select {

struct streaming {
  static constexpr std::string_view name = "streaming";
  index_t sink = 4;
  index_t window = 1024;

  // A budget of k tokens: `sink` sinks and the rest as window.
  static streaming with_budget(index_t k, index_t sink = 4) {
    return {std::min(sink, k), k - std::min(sink, k)};
  }

  using index = no_index;
  using selection = floe::selection;

  template <KvView KV>
  index build(const KV&) const { return {}; }

  // A cache shorter than S + W is attended whole: a window larger than the cache covers it.
  template <KvView KV, class Exec>
  void select(const index&, const KV& kv, const query_group&, const Exec&, selection& out, stats&) const {
    out.clear();
    const index_t n = kv.n();
    const index_t s = std::min(sink, n);
    const index_t w0 = n - std::min(window, n);
    if (s >= w0) {
      out.add(0, n);
    } else {
      out.add(0, s);
      out.add(w0, n);
    }
  }
};

}  // namespace floe::select
