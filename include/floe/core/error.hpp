// The one error type of floe: every rejected input names the argument at fault.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace floe {

// Thrown for every bad argument. `argument()` is the name a caller would grep for
// (e.g. "query", "keys.row_stride", "budget"); `what()` is a full sentence.
class invalid_argument : public std::invalid_argument {
 public:
  invalid_argument(std::string argument, const std::string& message)
      : std::invalid_argument("floe: invalid argument '" + argument + "': " + message),
        argument_(std::move(argument)) {}
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

// require(cond, "arg", "message parts", ...) throws floe::invalid_argument if !cond.
template <class... Parts>
inline void require(bool condition, const char* argument, const Parts&... parts) {
  if (!condition) throw invalid_argument(argument, detail::concat(parts...));
}

}  // namespace floe
