// loom-train's command line: a bad number is one line naming the flag and a non-zero exit, before anything is built
// or read (issue 19: --log-interval 0 divided by zero, --clip nan and negative counts were taken).
#include <sys/wait.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <string>

#include "loom/common/error.h"
#include "loom/data/token_file.h"
#include "loom/io/hf_model_dir.h"
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

std::map<std::string, std::string> files_of(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out[e.path().filename().string()] = test::read_all(e.path().string());
  return out;
}

// Nothing lost (issue 19): a resume from a broken checkpoint stops before it writes anything, and no run writes over
// an existing checkpoint unless --overwrite-checkpoints says so; resuming from the directory continues past it.
TEST(LoomTrainCli, CheckpointsAreNeverWrittenOverUnlessAsked) {
  namespace fs = std::filesystem;
  const std::string shard = tiny_shard();
  test::TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const std::string common = "--train-data " + shard + " --model d2 -b 1 -t 8 --warmup 0 --sample-tokens 0 " +
                             "--eval-batches 1 --checkpoint-interval 1 --checkpoint-dir " + dir.string() + " ";
  AppRun first = run_loom_train(common + "--steps 2");
  ASSERT_EQ(first.status, 0) << first.output;
  const auto good = files_of(dir);
  ASSERT_TRUE(good.count("step_000001.safetensors") && good.count("step_000002.safetensors")) << first.output;

  // A fresh run into the same directory would write step 1 and 2 again: refused before training.
  AppRun fresh = run_loom_train(common + "--steps 3");
  EXPECT_EQ(WEXITSTATUS(fresh.status), 1) << fresh.output;
  EXPECT_NE(fresh.output.find("would write over the existing checkpoint"), std::string::npos) << fresh.output;
  EXPECT_NE(fresh.output.find("--overwrite-checkpoints"), std::string::npos) << fresh.output;
  EXPECT_EQ(fresh.output.find("step     1/"), std::string::npos) << "it trained first\n" << fresh.output;
  EXPECT_EQ(files_of(dir), good);

  // The latest checkpoint broken (truncated): the resume stops, and every other file is as it was.
  const fs::path latest = dir / "step_000002.safetensors";
  fs::resize_file(latest, fs::file_size(latest) / 2);
  auto broken = files_of(dir);
  AppRun bad = run_loom_train(common + "--steps 4 --resume " + dir.string());
  EXPECT_EQ(WEXITSTATUS(bad.status), 1) << bad.output;
  EXPECT_NE(bad.output.find(latest.string()), std::string::npos) << bad.output;
  EXPECT_EQ(files_of(dir), broken);

  // Resuming from step 1 would write step 2 over the (broken) file: refused without the flag, done with it.
  const std::string from1 = common + "--steps 3 --resume " + (dir / "step_000001.safetensors").string();
  AppRun refused = run_loom_train(from1);
  EXPECT_EQ(WEXITSTATUS(refused.status), 1) << refused.output;
  EXPECT_NE(refused.output.find("step_000002.safetensors"), std::string::npos) << refused.output;
  EXPECT_EQ(files_of(dir), broken);
  AppRun replaced = run_loom_train(from1 + " --overwrite-checkpoints");
  ASSERT_EQ(replaced.status, 0) << replaced.output;
  EXPECT_NE(files_of(dir).at("step_000002.safetensors"), broken.at("step_000002.safetensors"));

  // Resuming from the directory continues past its latest (step 3): not an overwrite.
  const auto before = files_of(dir);
  AppRun cont = run_loom_train(common + "--steps 4 --resume " + dir.string());
  ASSERT_EQ(cont.status, 0) << cont.output;
  EXPECT_NE(cont.output.find("resumed at step 3"), std::string::npos) << cont.output;
  auto after = files_of(dir);
  EXPECT_TRUE(after.count("step_000004.safetensors"));
  for (const auto& [name, bytes] : before) {
    if (name != "latest") EXPECT_EQ(after.at(name), bytes) << name << " changed";
  }
  std::remove(shard.c_str());
}

// The temporaries of killed writes are removed at the start, with a note; a writer's that may still run is kept.
TEST(LoomTrainCli, StaleTemporariesAreCleanedAtTheStart) {
  namespace fs = std::filesystem;
  const std::string shard = tiny_shard();
  test::TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  fs::create_directories(dir);
  // pid 0 can be no writer's; an hour old.
  const fs::path stale = dir / ".loom.tmp.step_000007.safetensors.0.1234abcd";
  const fs::path live = dir / (".loom.tmp.step_000008.safetensors." + std::to_string(::getpid()) + ".99");
  const fs::path other = dir / "notes.tmp.txt";  // not ours: never touched
  for (const auto& p : {stale, live, other}) {
    test::write_all(p.string(), "half a checkpoint");
    fs::last_write_time(p, fs::file_time_type::clock::now() - std::chrono::hours(1));
  }
  AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --warmup 0 --sample-tokens 0 " +
                            "--eval-batches 1 --steps 1 --checkpoint-dir " + dir.string());
  std::remove(shard.c_str());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("removed the temporary of an interrupted write: " + stale.string()), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live)) << "the temporary of a running writer (this test) was removed";
  EXPECT_TRUE(fs::exists(other));
}
AppRun run_loom_train_with(const std::string& prefix, const std::string& args,
                           const std::string& exe = LOOM_TRAIN_EXE) {
  AppRun r;
  FILE* p = popen((prefix + exe + " " + args + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.output.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

// Sharded checkpoints through the apps (issue 16): loom-train under `mpirun -np 2 --zero 3` writes step_NNNNNN/
// directories; one process without ZeRO resumes from one and reaches the same loss at the last step; loom-export
// consolidates the sharded checkpoint into Hugging Face weights equal to the checkpoint's parameters.
std::map<int64_t, double> losses_in(const std::filesystem::path& metrics) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("train/loss")) out[j.at("step").get<int64_t>()] = j.at("train/loss").get<double>();
  }
  return out;
}

TEST(LoomTrainCli, ShardedCheckpointFromMpirunResumesInOneProcessAndExports) {
  namespace fs = std::filesystem;
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  test::TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const std::string shard = tmp.file("train.bin");
  std::vector<int32_t> tokens(8192);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7919 + i / 3) % 300);
  data::write_token_file(shard, tokens);
  const std::string common = "--train-data " + shard + " --model d2 -b 2 -t 16 --total-batch-tokens 64 --steps 4 " +
                             "--warmup 1 --sample-tokens 0 --eval-interval 0 --seed 7 ";
  const std::string mpirun = "OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 ";
  AppRun two = run_loom_train_with(mpirun, common + "--zero 3 --checkpoint-interval 2 --checkpoint-dir " + dir.string() +
                                               " --log-dir " + tmp.file("two"));
  ASSERT_EQ(two.status, 0) << two.output;
  ASSERT_NE(two.output.find("world 2"), std::string::npos) << "loom-train did not run as 2 ranks\n" << two.output;
  for (const char* step : {"step_000002", "step_000004"}) {
    EXPECT_TRUE(fs::exists(dir / step / "meta.json")) << step;
    EXPECT_TRUE(fs::exists(dir / step / "rank00000.safetensors")) << step;
    EXPECT_TRUE(fs::exists(dir / step / "rank00001.safetensors")) << step;
  }
  std::ifstream latest((dir / "latest").string());
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "step_000004");

  AppRun one = run_loom_train(common + "--resume " + (dir / "step_000002").string() + " --log-dir " + tmp.file("one") +
                              " --checkpoint-format single --checkpoint-dir " + tmp.file("single"));
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NE(one.output.find("resumed at step 2"), std::string::npos) << one.output;
  auto want = losses_in(tmp.path() / "two" / "metrics.jsonl"), got = losses_in(tmp.path() / "one" / "metrics.jsonl");
  ASSERT_TRUE(want.count(4) && got.count(4)) << one.output;
  EXPECT_NEAR(got[4], want[4], 1e-5 * std::abs(want[4])) << "1 process resumed from 2 ranks' ZeRO-3 checkpoint";
  EXPECT_FALSE(got.count(1)) << "the resumed run trained step 1 again";

  // loom-export consolidates the sharded checkpoint.
  const std::string exporter = (fs::path(LOOM_TRAIN_EXE).parent_path() / "loom-export").string();
  if (!fs::exists(exporter)) GTEST_SKIP() << "no loom-export beside loom-train";
  const std::string out = tmp.file("hf.safetensors");
  AppRun ex = run_loom_train_with("", "--checkpoint " + (dir / "step_000004").string() + " --hf " + out +
                                          " --llmc " + tmp.file("model.bin"), exporter);
  ASSERT_EQ(ex.status, 0) << ex.output;
  // Against an independent reference: the one-process run's own single-file checkpoint at step 4 (the same training
  // within f32 rounding), loaded by the old path.
  io::SafetensorsFile hf = io::load_safetensors_file(out);
  auto reference = io::load_model((tmp.path() / "single" / "step_000004.safetensors").string());
  double worst = 0;
  for (auto& [n, t] : reference->hf_state_dict()) {
    ASSERT_TRUE(hf.tensors.count(n)) << n;
    auto a = to_vector<double>(t), b = to_vector<double>(hf.tensors.at(n));
    ASSERT_EQ(a.size(), b.size()) << n;
    for (size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::abs(a[k] - b[k]));
  }
  EXPECT_LT(worst, 1e-5) << "loom-export of the sharded checkpoint differs from the single-file one";
  EXPECT_EQ(hf.tensors.size(), reference->hf_state_dict().size());
  EXPECT_TRUE(fs::exists(tmp.file("model.bin")));
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
