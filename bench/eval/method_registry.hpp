// The method configurations floe's programs can pick by name (floe-eval --methods,
// examples/smollm --attn). Adding a method is one method<E>(...) line below.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/core/budget.hpp"
#include "floe/estimator.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/oracle_topk.hpp"
#include "floe/select/streaming.hpp"

namespace floe::eval {

template <Executor E>
struct method_entry {
  std::string name;
  std::string description;
  bool uses_budget = true;  // false: evaluated once, at the full cache (dense)
  std::function<any_estimator<E>(budget)> make;
};

// make(budget b, index_t n) -> floe::estimator<S, R> for a KV head of n tokens.
template <Executor E, class Make>
method_entry<E> method(std::string name, std::string description, Make make, bool uses_budget = true) {
  auto erase = [name, make](budget b) {
    return any_estimator<E>::from(name, [make, b](index_t n) { return make(b, n); });
  };
  return {std::move(name), std::move(description), uses_budget, std::move(erase)};
}

template <Executor E>
std::vector<method_entry<E>> registered_methods() {
  using floe::estimator;
  namespace sel = floe::select;
  namespace res = floe::residual;
  return {
      method<E>("dense", "every token exact; the accuracy and speed baseline (budget ignored)",
                [](budget, index_t) { return estimator<sel::dense, res::none>{}; }, false),
      method<E>("streaming", "4 sink tokens + the most recent tokens, budget tokens in all; selection only",
                [](budget b, index_t n) { return estimator<sel::streaming, res::none>{sel::streaming::with_budget(b.resolve(n)), {}}; }),
      method<E>("oracle_topk", "exact top-K by true attention weight (GQA group sum); selection only; scans every key",
                [](budget b, index_t n) { return estimator<sel::oracle_topk, res::none>{{b.resolve(n)}, {}}; }),
  };
}

// The entry called `name`; an unknown name is an error listing the known ones.
template <Executor E>
const method_entry<E>& find_method(const std::vector<method_entry<E>>& methods, const std::string& name,
                                   const char* argument = "method") {
  std::string known;
  for (const auto& m : methods) {
    if (m.name == name) return m;
    known += known.empty() ? m.name : ", " + m.name;
  }
  throw invalid_argument(argument, floe::detail::concat("unknown method '", name, "'; registered: ", known));
}

// The entry would dangle with the temporary registry.
template <Executor E>
const method_entry<E>& find_method(std::vector<method_entry<E>>&&, const std::string&, const char* = "method") = delete;

}  // namespace floe::eval
