// Argument checks shared by every kernel: one macro, one exception type per failure class.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace trainfast {

// Raised when a long computation is stopped by its caller (Ctrl-C); the bindings map it to
// KeyboardInterrupt.
class Interrupted : public std::runtime_error {
 public:
  Interrupted() : std::runtime_error("interrupted") {}
};

namespace detail {

template <typename T>
std::string format_value(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

[[noreturn]] inline void throw_invalid_argument(const char* name, const std::string& value,
                                                const char* requirement) {
  throw std::invalid_argument(std::string(name) + " " + requirement + " (got " + value + ")");
}

}  // namespace detail
}  // namespace trainfast

// TF_CHECK_ARG(num_bins > 0, "bins", num_bins, "must be positive") throws
// std::invalid_argument("bins must be positive (got 0)"), which Python sees as ValueError.
#define TF_CHECK_ARG(cond, name, value, requirement)                                         \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      ::trainfast::detail::throw_invalid_argument((name),                                     \
                                                  ::trainfast::detail::format_value(value), \
                                                  (requirement));                            \
    }                                                                                          \
  } while (0)
