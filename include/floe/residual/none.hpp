// Residual `none`: drop the tokens outside the exact set, i.e. renormalise the softmax
// over what was read (selection only). The baseline every residual must beat.
#pragma once

#include <string_view>

#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"

namespace floe::residual {

struct none {
  static constexpr std::string_view name = "none";
  using index = no_index;

  template <KvView KV, class Selector>
  index build(const KV&, const Selector&, const typename Selector::index&) const { return {}; }

  template <KvView KV, class Selection, class Exec, class Acc>
  void estimate(const index&, const KV&, const query_group&, const Selection&, const Exec&, partial_set<Acc>&,
                stats&) const {}
};

}  // namespace floe::residual
