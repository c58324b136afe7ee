// What the loom-train command-line tests share: a small token shard, and the step lines of a run's output.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "loom/data/token_file.h"
#include "test_files.h"
#include "test_util.h"

namespace loom::test {

// Tokens below 400 (a d2 model's vocabulary is GPT-2's: any id fits), fresh for every test.
inline std::string small_vocab_shard(const TempDir& tmp, const std::string& name = "train.bin", size_t count = 8192) {
  const std::string path = tmp.file(name);
  std::vector<int32_t> tokens(count);
  const uint64_t seed = fresh_seed();
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7919 + seed + i / 5) % 400);
  data::write_token_file(path, tokens);
  return path;
}

// The step lines' "loss X | lr Y" by step ("step     3/4 | loss 10.8559 | lr 4.65e-04 | ...").
inline std::map<int64_t, std::string> step_lines(const std::string& output) {
  std::map<int64_t, std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    long step = 0, total = 0;
    if (std::sscanf(line.c_str(), "step %ld/%ld |", &step, &total) != 2) continue;
    const size_t a = line.find("| loss"), b = line.find("| norm");
    if (a != std::string::npos && b != std::string::npos) out[step] = line.substr(a, b - a);
  }
  return out;
}

}  // namespace loom::test
