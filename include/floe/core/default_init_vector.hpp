// floe::default_init_vector<T>: a std::vector whose resize() default-initialises new
// elements (indeterminate for float) instead of zeroing them. For per-step buffers that
// are written in full before they are read: not zeroing a selection's 2.5 MiB of score
// estimates every step made a selection by estimate 2-5 % faster (docs/methods/retrieval-completion.md).
#pragma once

#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace floe {

template <class T>
struct default_init_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = default_init_allocator<U>;
  };
  default_init_allocator() noexcept = default;
  template <class U>
  default_init_allocator(const default_init_allocator<U>&) noexcept {}

  template <class U>
  void construct(U* p) noexcept(noexcept(::new(static_cast<void*>(p)) U)) {
    ::new (static_cast<void*>(p)) U;  // default-initialisation: no zeroing
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using default_init_vector = std::vector<T, default_init_allocator<T>>;

}  // namespace floe
