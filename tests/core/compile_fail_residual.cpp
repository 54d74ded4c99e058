// Must NOT compile: `not_a_residual` has no estimate(). The test checks the message.
#include "floe/estimator.hpp"
#include "floe/select/dense.hpp"

struct not_a_residual {
  static constexpr const char* name = "broken";
  struct index {
    std::uint64_t bytes() const { return 0; }
  };
  template <class KV, class S>
  index build(const KV&, const S&, const typename S::index&) const { return {}; }
};

int main() {
  floe::estimator<floe::select::dense, not_a_residual> e;
  (void)e;
}
