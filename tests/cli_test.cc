// loom-train's command line: a bad number is one line naming the flag and a non-zero exit, before anything is built
// or read (issue 19: --log-interval 0 divided by zero, --clip nan and negative counts were taken).
#include <sys/wait.h>

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <string>

#include "loom/common/error.h"
#include "loom/data/token_file.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

#ifdef LOOM_TRAIN_EXE
struct AppRun {
  int status = 0;
  std::string output;
};
AppRun run_loom_train(const std::string& args) {
  AppRun r;
  FILE* p = popen((std::string(LOOM_TRAIN_EXE) + " " + args + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.output.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

TEST(LoomTrainCli, BadNumbersAreOneLineNamingTheFlag) {
  const struct {
    const char* args;
    const char* flag;
  } cases[] = {
      {"--log-interval 0", "--log-interval"},        {"--clip nan", "--clip"},
      {"--clip inf", "--clip"},                      {"--total-batch-tokens -8", "--total-batch-tokens"},
      {"--checkpoint-interval -1", "--checkpoint-interval"}, {"--eval-batches -2", "--eval-batches"},
      {"--sample-tokens -5", "--sample-tokens"},
  };
  for (const auto& c : cases) {
    // The data file does not exist: a flag that got through would fail later, on the data, with another message.
    AppRun r = run_loom_train(std::string("--train-data /nonexistent/shard.bin ") + c.args);
    EXPECT_NE(r.status, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.flag), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("nonexistent"), std::string::npos) << c.args << " got past the flags\n" << r.output;
  }
  AppRun ok = run_loom_train("--train-data /nonexistent/shard.bin --clip 0.5 --log-interval 3");
  EXPECT_NE(ok.output.find("nonexistent"), std::string::npos) << "good flags must reach the data\n" << ok.output;
}

// Errors that are not loom::Error (a log directory that cannot be made throws std::filesystem_error) end the run with
// one line and exit status 1, not an abort.
TEST(LoomTrainCli, AnUnwritableLogDirIsAnErrorNotAnAbort) {
  const std::string shard = ::testing::TempDir() + "loom_cli_shard_" + std::to_string(test::fresh_seed()) + ".bin";
  std::vector<int32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7919 % 50000);
  data::write_token_file(shard, tokens);
  AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --steps 1 --warmup 0 --sample-tokens 0 " +
                            "--log-dir /proc/loom_cannot_be_here");
  std::remove(shard.c_str());
  ASSERT_TRUE(WIFEXITED(r.status)) << "killed by a signal\n" << r.output;
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.output;
  EXPECT_NE(r.output.find("loom-train: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("/proc/loom_cannot_be_here"), std::string::npos) << r.output;
}

std::string tiny_shard() {
  const std::string shard = ::testing::TempDir() + "loom_cli_shard_" + std::to_string(test::fresh_seed()) + ".bin";
  std::vector<int32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7919 % 50000);
  data::write_token_file(shard, tokens);
  return shard;
}

// A checkpoint directory that cannot be made is found before training, not at the first save after it.
TEST(LoomTrainCli, AnUnusableCheckpointDirIsFoundAtTheStart) {
  const std::string shard = tiny_shard();
  AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --steps 1 --warmup 0 " +
                            "--sample-tokens 0 --checkpoint-dir /proc/loom_cannot_be_here");
  std::remove(shard.c_str());
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.output;
  EXPECT_NE(r.output.find("--checkpoint-dir: cannot create '/proc/loom_cannot_be_here'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step "), std::string::npos) << "it trained first\n" << r.output;
}

// A checkpoint whose state lacks an entry is an error naming the file (it aborted on a JSON exception).
TEST(LoomTrainCli, ACheckpointStateMissingAKeyNamesTheFile) {
  const std::string shard = tiny_shard();
  test::TempDir dir;
  const std::string common = "--train-data " + shard + " --model d2 -b 1 -t 8 --warmup 0 --sample-tokens 0 ";
  AppRun first = run_loom_train(common + "--steps 1 --checkpoint-dir " + dir.path().string());
  ASSERT_EQ(first.status, 0) << first.output;
  std::string ckpt;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    if (e.path().extension() == ".safetensors" && e.path().string().find("optim") == std::string::npos)
      ckpt = e.path().string();
  ASSERT_FALSE(ckpt.empty());
  io::SafetensorsFile file = io::load_safetensors_file(ckpt);
  auto state = nlohmann::json::parse(file.metadata.at("state"));
  state.erase("step");
  file.metadata["state"] = state.dump();
  io::save_safetensors(ckpt, file.tensors, file.metadata);
  AppRun r = run_loom_train(common + "--steps 2 --resume " + ckpt);
  std::remove(shard.c_str());
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.output;
  EXPECT_NE(r.output.find("resume: '" + ckpt + "' has corrupt state metadata"), std::string::npos) << r.output;
}
#endif

TEST(ModelConfigChecks, ZeroKvHeadsIsAnErrorNotADivisionByZero) {
  try {
    nn::ModelConfig::from_json(R"({"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 0, "n_embd": 64})");
    FAIL() << "n_kv_head 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head=0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom
