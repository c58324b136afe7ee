// loom::Error and the checks that throw it. A user's mistake never aborts the process.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const std::string& msg);
[[noreturn]] void throw_internal(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace loom

// Throws loom::Error with the streamed arguments as its message. Use for errors a user can cause.
#define LOOM_THROW(...) ::loom::detail::throw_error(::loom::detail::str_cat(__VA_ARGS__))
// A user-facing check: the message should name the op, shapes, dtypes and devices involved.
#define LOOM_REQUIRE(cond, ...) \
  do {                          \
    if (!(cond)) LOOM_THROW(__VA_ARGS__); \
  } while (0)
// An internal invariant. Also throws (with file and line), so a bug surfaces as an exception, not an abort.
#define LOOM_CHECK(cond, ...)                                                                          \
  do {                                                                                                 \
    if (!(cond))                                                                                       \
      ::loom::detail::throw_internal(#cond, __FILE__, __LINE__, ::loom::detail::str_cat("" __VA_ARGS__)); \
  } while (0)
