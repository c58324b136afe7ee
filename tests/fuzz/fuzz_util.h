// Shared by the fuzz targets: the parsers under test read files, so each input is written to a private file first.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "loom/common/error.h"

namespace loom::fuzz {

// A file of this process in /dev/shm (or the temp dir), rewritten for each input.
inline std::string scratch_path(const std::string& name) {
  // Never destroyed: the exit handler below still reads it after static destructors ran.
  static const std::string* dir = [] {
    std::filesystem::path d = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    d /= "loom_fuzz_" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    std::atexit([] {  // -runs=N and -merge end with exit(); a finding's abort leaves the files for the report
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return new std::string(d.string());
  }();
  return *dir + "/" + name;
}

inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_path(name);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) __builtin_trap();
  std::fclose(f);
  return path;
}

// Splits an input at the first occurrence of `sep` (the whole input and "" when absent).
inline std::pair<std::string_view, std::string_view> split(std::string_view in, std::string_view sep) {
  size_t at = in.find(sep);
  if (at == std::string_view::npos) return {in, {}};
  return {in.substr(0, at), in.substr(at + sep.size())};
}

// A parser may refuse an input only with loom::Error; anything else escaping is a finding (libFuzzer reports the
// uncaught exception as a crash). LOOM_FUZZ_VERBOSE=1 prints each refusal (to check that the seeds load).
template <class F>
void expect_only_loom_errors(F&& f) {
  static const bool verbose = std::getenv("LOOM_FUZZ_VERBOSE") != nullptr;
  try {
    f();
    if (verbose) std::fprintf(stderr, "accepted\n");
  } catch (const Error& e) {
    if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
  }
}

}  // namespace loom::fuzz
