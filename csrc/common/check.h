// Argument checks shared by every kernel: one macro, one exception type per failure class.
#pragma once

#include <charconv>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace trainfast {

// Raised when a long computation is stopped by its caller (Ctrl-C); the bindings raise what the
// Python signal handler raised (KeyboardInterrupt for Ctrl-C, SystemExit, TimeoutError, ...).
class Interrupted : public std::runtime_error {
 public:
  Interrupted() : std::runtime_error("interrupted") {}
};

// A file could not be opened or read; `error_number` is errno. Python sees an OSError (its errno
// subclass, e.g. FileNotFoundError) carrying the path.
class FileError : public std::runtime_error {
 public:
  FileError(const std::string& path, int error_number)
      : std::runtime_error(path), path_(path), error_number_(error_number) {}
  const std::string& path() const { return path_; }
  int error_number() const { return error_number_; }

 private:
  std::string path_;
  int error_number_;
};

namespace detail {

// No iostreams: built with a toolchain that links libstdc++ into the module (GCC 13 at /opt/gcc on
// the GPU machines' image), the module's copy of `out << value` segfaulted on the first message.
template <typename T>
std::string format_value(const T& value) {
  if constexpr (std::is_floating_point_v<T>) {
    char text[64];
    return std::string(text, std::to_chars(text, text + sizeof(text), value).ptr);  // shortest round trip
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(value);
  } else {
    return std::string(value);
  }
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
