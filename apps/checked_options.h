// Checks every app applies to its command line after declaring its options (one place, not per flag).
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>

namespace loom::apps {

// A number in a message as it was given: the shortest text that reads back as the same double (1.0000001, never
// the stream's six digits "1").
inline std::string exact_number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// An option's type as CLI11 names it, split at the first ':': {"INT", ">= 1"} for "INT:>= 1" (the type, then the
// validators' descriptions; "" where there are none).
inline std::pair<std::string, std::string> type_and_checks(const CLI::Option& opt) {
  const std::string full = opt.get_type_name();
  const size_t colon = full.find(':');
  return {full.substr(0, colon), colon == std::string::npos ? "" : full.substr(colon + 1)};
}

// CLI11 2.1 (as Debian ships it) takes an integer past 64 bits as the nearest bound and wraps a negative one into
// an unsigned option without an error (--steps 99999999999999999999 became INT64_MAX, --seed -1 2^64-1). This puts a
// range check in front of every integer option of `app` and its subcommands, so such a value is an error naming the
// flag. Narrower types (int) are already refused by CLI11 when the 64-bit value does not fit them.
inline void check_integer_options(CLI::App& app) {
  for (CLI::Option* opt : app.get_options([](const CLI::Option*) { return true; })) {
    const std::string type = type_and_checks(*opt).first;
    if (type != "INT" && type != "UINT") continue;
    const bool is_unsigned = type == "UINT";
    opt->check(CLI::Validator(
        [is_unsigned](std::string& v) -> std::string {
          size_t first = 0;
          while (first < v.size() && std::isspace(static_cast<unsigned char>(v[first]))) ++first;
          if (is_unsigned && first < v.size() && v[first] == '-')
            return "must be a non-negative whole number, got " + v;
          errno = 0;
          char* end = nullptr;
          if (is_unsigned) (void)std::strtoull(v.c_str(), &end, 0);
          else (void)std::strtoll(v.c_str(), &end, 0);
          if (errno == ERANGE)
            return "is out of range, got " + v + (is_unsigned ? " (at most 18446744073709551615)"
                                                              : " (within -9223372036854775808..9223372036854775807)");
          return "";  // a value that is not a number at all is CLI11's to report
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) check_integer_options(*sub);
}

}  // namespace loom::apps

#include <filesystem>
#include <new>
#include <stdexcept>

#include "loom/core/device_runtime.h"
#include "loom/io/read_file.h"

namespace loom::apps {

// An exception as the one line an app prints after "APP: error: ": the library's own text, with what a standard
// library or JSON exception says put in Loom's words ("filesystem error: ..." names the path, bad_alloc says memory).
inline std::string error_text(const std::exception& e) {
  if (const auto* fe = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) {
    std::string m = "'" + fe->path1().string() + "'";
    if (!fe->path2().empty()) m += " -> '" + fe->path2().string() + "'";
    return m + ": " + fe->code().message();
  }
  if (dynamic_cast<const std::bad_alloc*>(&e) || dynamic_cast<const std::length_error*>(&e)) {
    // What was held and what the machine has: the sizes that tell a too-large model from a corrupt size in a file.
    auto& cpu = device_runtime(DeviceType::kCPU);
    const MemoryStats held = cpu.memory_stats(0);
    const size_t total = cpu.total_memory(0);
    return std::string(dynamic_cast<const std::bad_alloc*>(&e) ? "out of host memory" : "a size too large for memory") +
           ": an allocation failed with " + io::byte_size_text(double(held.allocated)) + " in tensors (peak " +
           io::byte_size_text(double(held.peak_allocated)) + ")" +
           (total ? " of the machine's " + io::byte_size_text(double(total)) : std::string()) +
           " (is the model, the batch or an input file larger than this machine?)";
  }
  std::string m = e.what();
  if (m.rfind("[json.exception.", 0) == 0 && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
  return m;
}

}  // namespace loom::apps
