// Must NOT compile: `not_a_selector` lacks select(). The test checks the message.
#include "floe/estimator.hpp"
#include "floe/residual/none.hpp"

struct not_a_selector {
  static constexpr const char* name = "broken";
  struct index {
    std::uint64_t bytes() const { return 0; }
  };
  using selection = floe::selection;
  template <class KV>
  index build(const KV&) const { return {}; }
};

int main() {
  floe::estimator<not_a_selector, floe::residual::none> e;
  (void)e;
}
