// floe::any_estimator<E>: a floe::estimator<S, R> whose type is chosen at run time, for
// programs that pick a method by name (the evaluation tool, the real-model example).
// The executor E stays a compile-time choice; the KV view may be contiguous or paged, in
// any element type. Costs one virtual call per decode.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "floe/core/concepts.hpp"
#include "floe/estimator.hpp"

namespace floe {

// The KV views an any_estimator accepts.
using any_kv_view = std::variant<const kv_view<float>*, const kv_view<half>*, const kv_view<bfloat16>*,
                                 const paged_kv_view<float>*, const paged_kv_view<half>*,
                                 const paged_kv_view<bfloat16>*>;

template <Executor E>
class any_estimator {
 public:
  // Per (layer, KV head) state from build(); only the any_estimator that built it (or a
  // copy of it) may decode with it.
  class state {
   public:
    state() = default;
    std::uint64_t bytes() const { return bytes_; }  // memory held by the index

   private:
    friend class any_estimator;
    std::shared_ptr<void> impl_;  // the held estimator and its state; append() updates it
    const void* owner_ = nullptr;
    std::uint64_t bytes_ = 0;
  };

  any_estimator() = default;

  // Wraps make(n) -> floe::estimator<S, R>, called by build() with the cache length n, so
  // that budgets given as fractions resolve against each KV head's own length.
  template <class Make>
  static any_estimator from(std::string name, Make make) {
    using est = std::invoke_result_t<const Make&, index_t>;
    static_assert(requires(const est& e, const kv_view<float>& kv) { e.build(kv); },
                  "floe::any_estimator::from: make(n) must return a floe::estimator<S, R>");
    any_estimator a;
    a.name_ = std::move(name);
    a.model_ = std::make_shared<const model_for<Make>>(std::move(make));
    return a;
  }

  const std::string& name() const { return name_; }
  explicit operator bool() const { return model_ != nullptr; }

  template <KvView KV>
  state build(const KV& kv) const {
    require(model_ != nullptr, "estimator", "empty any_estimator (default-constructed)");
    return model_->build(any_kv_view(&kv));
  }

  // estimator<S, R>::append for the state's estimator: call it as the cache grows.
  template <KvView KV>
  void append(state& st, const KV& kv) const {
    require(model_ != nullptr, "estimator", "empty any_estimator (default-constructed)");
    require(st.impl_ != nullptr && st.owner_ == model_.get(), "state",
            "was not built by this estimator (", name_, ")");
    model_->append(st, any_kv_view(&kv));
  }

  // estimator<S, R>::decode for the state's estimator; output rows are float.
  template <KvView KV>
  void decode(const state& st, const KV& kv, const query_group& q, const E& exec, const output_group<float>& out,
              stats& io) const {
    require(model_ != nullptr, "estimator", "empty any_estimator (default-constructed)");
    require(st.impl_ != nullptr && st.owner_ == model_.get(), "state",
            "was not built by this estimator (", name_, ")");
    model_->decode(st, any_kv_view(&kv), q, exec, out, io);
  }

 private:
  struct model {
    virtual ~model() = default;
    virtual state build(any_kv_view kv) const = 0;
    virtual void decode(const state& st, any_kv_view kv, const query_group& q, const E& exec,
                        const output_group<float>& out, stats& io) const = 0;
    virtual void append(state& st, any_kv_view kv) const = 0;
  };

  template <class Make>
  struct model_for final : model {
    using est = std::invoke_result_t<const Make&, index_t>;
    struct held {
      est estimator;
      typename est::state state;
    };
    Make make;

    explicit model_for(Make m) : make(std::move(m)) {}

    state build(any_kv_view kv) const override {
      return std::visit(
          [&](const auto* view) {
            est e = make(view->n());
            auto s = e.build(*view);
            state out;
            out.bytes_ = s.bytes();
            out.impl_ = std::make_shared<held>(held{std::move(e), std::move(s)});
            out.owner_ = this;
            return out;
          },
          kv);
    }

    void decode(const state& st, any_kv_view kv, const query_group& q, const E& exec, const output_group<float>& out,
                stats& io) const override {
      const held& h = *static_cast<const held*>(st.impl_.get());
      std::visit([&](const auto* view) { h.estimator.decode(h.state, *view, q, exec, out, io); }, kv);
    }

    void append(state& st, any_kv_view kv) const override {
      // A copied state shares its index: copy-on-append keeps the other copy unchanged.
      if (st.impl_.use_count() > 1) st.impl_ = std::make_shared<held>(*static_cast<const held*>(st.impl_.get()));
      held& h = *static_cast<held*>(st.impl_.get());
      std::visit([&](const auto* view) { h.estimator.append(h.state, *view); }, kv);
      st.bytes_ = h.state.bytes();
    }
  };

  std::string name_;
  std::shared_ptr<const model> model_;
};

}  // namespace floe
