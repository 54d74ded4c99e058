// Selector `anchor_reuse` (Kascade): an anchor layer scores every key and attends the
// exact top k of its GQA group's summed attention weights; every other layer attends the
// set its anchor chose at this step, read from the head the plan maps it to, without
// scoring anything; the plan's dense layers attend everything. One selector per (layer,
// KV head): make them with at(layer, head).
// docs/methods/anchor-reuse.md.
#pragma once

#include <memory>
#include <string_view>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/select/anchor_plan.hpp"
#include "floe/select/scorers/group_weights.hpp"

namespace floe::select {

struct anchor_reuse {
  static constexpr std::string_view name = "anchor_reuse";
  index_t k = 0;  // tokens an anchor attends exactly; k >= n attends everything
  std::shared_ptr<anchor_store> store;  // shared by every (layer, KV head) of one model
  index_t layer = 0;
  index_t kv_head = 0;

  using index = no_index;
  using selection = floe::selection;

  // The selector of (layer, head), sharing this one's k and store.
  anchor_reuse at(index_t l, index_t h) const {
    require(store != nullptr, "store", "anchor_reuse needs an anchor_store (made from the anchor_plan)");
    require(l < store->plan().layers && h < store->plan().kv_heads, "layer", "(layer ", l, ", head ", h,
            ") is outside the plan's ", store->plan().layers, " x ", store->plan().kv_heads);
    return {k, store, l, h};
  }

  template <KvView KV>
  index build(const KV&) const {
    at(layer, kv_head);  // checks the store and the slot
    return {};
  }

  template <KvView KV, class Exec>
  void select(const index&, const KV& kv, const query_group& q, const Exec& exec, selection& out, stats& io) const {
    out.clear();
    const index_t n = kv.n();
    if (store->plan().is_dense(layer)) {
      out.add(0, n);
      return;
    }
    if (!store->plan().is_anchor(layer)) {
      // The anchor chose at the same n this step, so every range lies inside this cache.
      out.ranges = store->reused(layer, kv_head, n);
      return;
    }
    if (k >= n) {
      out.add(0, n);
    } else {
      add_group_top_k(kv, q, exec, k, out);
      out.keys_counted = true;
      io.key_bytes += static_cast<std::uint64_t>(n) * kv.d() * sizeof(typename KV::element_type);
    }
    store->put(layer, kv_head, n, out.ranges);
  }
};

}  // namespace floe::select
