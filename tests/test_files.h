// Test helpers for file work: a temporary directory per test, whole-file reads and writes, token shards for training
// runs, and error-message checks.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loom/common/error.h"
#include "loom/data/token_file.h"

namespace loom::test {

// A fresh directory, removed with everything in it when the object goes.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("loom_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }
  size_t count() const {
    return size_t(std::distance(std::filesystem::directory_iterator(path_), std::filesystem::directory_iterator()));
  }

 private:
  std::filesystem::path path_;
};

// Runs f, expecting loom::Error whose message contains every one of `parts`.
template <typename F>
void expect_error_mentioning(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected loom::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nlacks: " << p;
  }
}

inline std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// Writes a token shard with learnable structure to `path` and returns its tokens: n tokens repeating 0 .. period-1,
// about one in ten (as an mt19937 seeded with `seed` picks them) replaced by a draw from [0, vocab).
inline std::vector<int32_t> write_patterned_shard(const std::string& path, size_t n, uint32_t seed,
                                                  uint32_t vocab = 200, uint32_t period = 37) {
  std::mt19937 eng(seed);
  std::vector<int32_t> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = (eng() % 10 == 0) ? int32_t(eng() % vocab) : int32_t(i % period);
  data::write_token_file(path, tokens);
  return tokens;
}

}  // namespace loom::test
