// Selector `dense`: every token is exact. The baseline, and the check that the seams
// add no error.
#pragma once

#include <string_view>

#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"

namespace floe::select {

struct dense {
  static constexpr std::string_view name = "dense";
  using index = no_index;
  using selection = floe::selection;

  template <KvView KV>
  index build(const KV&) const { return {}; }

  template <KvView KV, class Exec>
  void select(const index&, const KV& kv, const query_group&, const Exec&, selection& out, stats&) const {
    out.clear();
    out.add(0, kv.n());
  }
};

}  // namespace floe::select
