// The region a residual summarises: between the selector's sink and tail window when it
// has them (topk_anchors, streaming), else the whole cache; and the window that later
// appends keep out of it.
#pragma once

#include <algorithm>

#include "floe/core/selection.hpp"

namespace floe::residual {

template <class S>
token_range anchored_region(const S& selector, index_t n) {
  if constexpr (requires { selector.sink; selector.window; }) {
    const index_t b = std::min<index_t>(selector.sink, n);
    return {b, std::max(b, n - std::min<index_t>(selector.window, n))};
  } else {
    return {0, n};
  }
}

template <class S>
index_t anchored_window(const S& selector) {
  if constexpr (requires { selector.window; }) return selector.window;
  else return 0;
}

}  // namespace floe::residual
