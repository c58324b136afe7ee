// loom-train's command line: a bad number is one line naming the flag and a non-zero exit, before anything is built
// or read (--log-interval 0 once divided by zero, --clip nan and negative counts were taken).
#include <sys/wait.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <string>

#include "loom/common/error.h"
#include "loom/data/token_file.h"
#include "loom/distributed/process_group.h"
#include "loom/io/atomic_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/train/checkpoint.h"
#include "test_files.h"
#include "train_output.h"
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

// A shard of 4,096 tokens in a fresh temporary file.
std::string tiny_shard() {
  const std::string shard = ::testing::TempDir() + "loom_cli_shard_" + std::to_string(test::fresh_seed()) + ".bin";
  std::vector<int32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7919 % 50000);
  data::write_token_file(shard, tokens);
  return shard;
}

// Errors that are not loom::Error (a log directory that cannot be made throws std::filesystem_error) end the run with
// one line and exit status 1, not an abort.
TEST(LoomTrainCli, AnUnwritableLogDirIsAnErrorNotAnAbort) {
  const std::string shard = tiny_shard();
  AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --steps 1 --warmup 0 --sample-tokens 0 " +
                            "--log-dir /proc/loom_cannot_be_here");
  std::remove(shard.c_str());
  ASSERT_TRUE(WIFEXITED(r.status)) << "killed by a signal\n" << r.output;
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.output;
  EXPECT_NE(r.output.find("loom-train: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("/proc/loom_cannot_be_here"), std::string::npos) << r.output;
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

// Nothing lost: a resume from a broken checkpoint stops before it writes anything, and no run writes over
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
    if (name != "latest") {
      EXPECT_EQ(after.at(name), bytes) << name << " changed";
    }
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
  // pid 0 of this host can be no writer's; an hour old.
  const std::string here = "@" + io::temp_owner_tag(0, io::host_id()).substr(2);
  const fs::path stale = dir / (".loom.tmp.step_000007.safetensors.0" + here + ".1234abcd");
  const fs::path live = dir / (".loom.tmp.step_000008.safetensors." + std::to_string(::getpid()) + here + ".99");
  // A sharded checkpoint's temporary directory of a killed run (this host) and of another host's writer.
  const fs::path stale_dir = dir / (".loom.tmp.step_000009.0" + here);
  const fs::path elsewhere_dir = dir / (".loom.tmp.step_000010.0@" + io::temp_owner_tag(0, io::host_id() ^ 1u).substr(2));
  const fs::path other = dir / "notes.tmp.txt";  // not ours: never touched
  for (const auto& p : {stale, live, other}) {
    test::write_all(p.string(), "half a checkpoint");
    fs::last_write_time(p, fs::file_time_type::clock::now() - std::chrono::hours(1));
  }
  for (const auto& d : {stale_dir, elsewhere_dir}) {
    fs::create_directories(d);
    test::write_all((d / "rank0.safetensors").string(), "half a shard");
    fs::last_write_time(d, fs::file_time_type::clock::now() - std::chrono::hours(1));
  }
  EXPECT_EQ(train::remove_stale_checkpoint_dirs(dir.string()), std::vector<std::string>{stale_dir.string()});
  EXPECT_TRUE(fs::exists(elsewhere_dir)) << "another host's running write was removed";
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

// Sharded checkpoints through the apps: loom-train under `mpirun -np 2 --zero 3` writes step_NNNNNN/
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
  if (!distributed::mpi_available()) GTEST_SKIP() << "this Loom was built without MPI (LOOM_MPI=OFF)";
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
// ---- resume and start-up, conveniences ----

// A shard of small token ids (the d2 model's 50257-token vocabulary holds them) with some structure to learn.
using test::small_vocab_shard;
using test::step_lines;

std::string checkpoint_file(const std::filesystem::path& dir, int step) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%06d.safetensors", step);
  return (dir / name).string();
}

// --resume alone continues the saved run: its model (d2, not the default d4), learning rate, warmup, batch and length
// come from the checkpoint, so the resumed steps print the uninterrupted run's losses and learning rates.
TEST(LoomTrainResume, TakesTheModelAndSettingsFromTheCheckpoint) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string dir = tmp.file("ck");
  AppRun full = run_loom_train("--train-data " + shard + " --model d2 -b 2 -t 16 --steps 4 --lr 1e-3 --warmup 1 " +
                               "--decay linear --final-lr-fraction 0.2 --seed 11 --sample-tokens 0 --eval-interval 0 " +
                               "--checkpoint-interval 2 --checkpoint-dir " + dir);
  ASSERT_EQ(full.status, 0) << full.output;
  AppRun resumed = run_loom_train("--train-data " + shard + " --sample-tokens 0 --eval-interval 0 --resume " +
                                  checkpoint_file(dir, 2) + " --checkpoint-dir " + tmp.file("ck2"));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("2 layers"), std::string::npos) << "not the checkpoint's model\n" << resumed.output;
  auto want = step_lines(full.output), got = step_lines(resumed.output);
  ASSERT_TRUE(want.count(3) && want.count(4)) << full.output;
  EXPECT_FALSE(got.count(2)) << resumed.output;
  EXPECT_EQ(got[3], want[3]) << resumed.output;
  EXPECT_EQ(got[4], want[4]) << resumed.output;
  EXPECT_EQ(resumed.output.find(" -> "), std::string::npos) << "nothing was changed\n" << resumed.output;
}

// Raising --steps keeps the saved schedule (the learning rate does not jump back up), says so, and --schedule-steps
// stretches it; a change to a setting that shapes the run is printed old -> new (the seed with what it still does);
// batch size and sequence length are refused with one line naming the flag; an old checkpoint without settings
// resumes with a note.
TEST(LoomTrainResume, ChangedSettingsArePrintedOrRefused) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string dir = tmp.file("ck");
  const std::string base = "--train-data " + shard + " --sample-tokens 0 --eval-interval 0 ";
  AppRun first = run_loom_train(base + "--model d2 -b 2 -t 16 --steps 4 --lr 1e-3 --warmup 1 --final-lr-fraction 0.1 " +
                                "--checkpoint-dir " + dir);
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string ckpt = checkpoint_file(dir, 4);
  // Each resume below starts again from step 4: they save elsewhere, each over the last one's.
  const std::string again = base + "--checkpoint-dir " + tmp.file("again") + " --overwrite-checkpoints ";

  AppRun longer = run_loom_train(again + "--resume " + ckpt + " --steps 6");
  ASSERT_EQ(longer.status, 0) << longer.output;
  EXPECT_NE(longer.output.find("resume: --steps 4 -> 6"), std::string::npos) << longer.output;
  EXPECT_NE(longer.output.find("schedule stays 4 steps long"), std::string::npos) << longer.output;
  auto lines = step_lines(longer.output);
  EXPECT_NE(lines[5].find("lr 1.00e-04"), std::string::npos) << "step 5 left the final learning rate\n"
                                                              << longer.output;
  AppRun stretched = run_loom_train(again + "--resume " + ckpt + " --steps 6 --schedule-steps 6");
  ASSERT_EQ(stretched.status, 0) << stretched.output;
  EXPECT_NE(stretched.output.find("--schedule-steps 4 -> 6"), std::string::npos) << stretched.output;
  EXPECT_EQ(step_lines(stretched.output)[5].find("lr 1.00e-04"), std::string::npos) << stretched.output;

  AppRun lr = run_loom_train(again + "--resume " + ckpt + " --steps 5 --lr 2e-3");
  ASSERT_EQ(lr.status, 0) << lr.output;
  EXPECT_NE(lr.output.find("resume: --lr 0.001 -> 0.002"), std::string::npos) << lr.output;
  EXPECT_NE(step_lines(lr.output)[5].find("lr 2.00e-04"), std::string::npos) << lr.output;

  AppRun seed = run_loom_train(again + "--resume " + ckpt + " --steps 5 --seed 5");
  ASSERT_EQ(seed.status, 0) << seed.output;
  EXPECT_NE(seed.output.find("resume: --seed 1337 -> 5 (the data order and the random streams continue"),
            std::string::npos) << seed.output;
  for (const char* flag : {"--batch-size 4", "--seq-len 8"}) {
    AppRun r = run_loom_train(base + "--resume " + ckpt + " --steps 6 " + flag);
    EXPECT_EQ(WEXITSTATUS(r.status), 1) << flag << "\n" << r.output;
    const std::string name = std::string(flag).substr(0, std::string(flag).find(' '));
    EXPECT_NE(r.output.find("resume: " + name + " "), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  AppRun other_model = run_loom_train(base + "--resume " + ckpt + " --steps 6 --model d3");
  EXPECT_EQ(WEXITSTATUS(other_model.status), 1) << other_model.output;
  EXPECT_NE(other_model.output.find("saved from another model than --model d3"), std::string::npos)
      << other_model.output;

  // A checkpoint from before the settings were saved: the command line's are used, with a note.
  io::SafetensorsFile file = io::load_safetensors_file(ckpt);
  auto state = nlohmann::json::parse(file.metadata.at("state"));
  ASSERT_TRUE(state.contains("settings"));
  EXPECT_EQ(state["settings"]["lr"].get<double>(), 1e-3);
  state.erase("settings");
  file.metadata["state"] = state.dump();
  const std::string old = tmp.file("old.safetensors");
  io::save_safetensors(old, file.tensors, file.metadata);
  AppRun legacy =
      run_loom_train(base + "--model d2 -b 2 -t 16 --steps 5 --warmup 1 --lr 3e-3 --decay constant --resume " + old);
  ASSERT_EQ(legacy.status, 0) << legacy.output;
  EXPECT_NE(legacy.output.find("holds no training settings"), std::string::npos) << legacy.output;
  EXPECT_NE(step_lines(legacy.output)[5].find("lr 3.00e-03"), std::string::npos) << legacy.output;
}

// A resume keeps every setting of the run: the dtype (shown in the banner), the validation data, the log directory
// and the tokenizer, from another working directory too; what the command line changes is printed old -> new.
TEST(LoomTrainResume, KeepsDtypeDataLogsAndTokenizer) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp), val = small_vocab_shard(tmp, "val.bin");
  const std::string dir = tmp.file("ck"), logs = tmp.file("logs");
  // Relative paths, given from tmp: the resume below runs elsewhere.
  AppRun made = run_loom_train_with("cd " + tmp.path().string() + " && ",
                                    "--train-data " + shard + " --model d2 -b 2 -t 16 --steps 2 --warmup 1 " +
                                        "--dtype bf16 --sample-tokens 0 --eval-interval 0 --eval-batches 1 " +
                                        "--val-data val.bin --log-dir logs --checkpoint-dir " + dir);
  ASSERT_EQ(made.status, 0) << made.output;
  EXPECT_NE(made.output.find("bf16 mixed precision"), std::string::npos) << made.output;
  AppRun resumed = run_loom_train("--train-data " + shard + " --steps 3 --resume " + dir);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("bf16 mixed precision"), std::string::npos) << "the dtype was dropped\n"
                                                                            << resumed.output;
  EXPECT_NE(resumed.output.find("validation tokens"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("step 3: val loss"), std::string::npos) << resumed.output;
  for (const char* kept : {"--dtype", "--val-data", "--log-dir", "--tokenizer"})
    EXPECT_EQ(resumed.output.find(std::string("resume: ") + kept), std::string::npos) << kept << "\n" << resumed.output;
  // The resumed run's lines went on into the first run's metrics.jsonl.
  const std::string metrics = test::read_all(tmp.file("logs/metrics.jsonl"));
  EXPECT_NE(metrics.find("\"step\":3"), std::string::npos) << metrics;
  // A change is taken and printed.
  AppRun changed = run_loom_train("--train-data " + shard + " --steps 3 --dtype f32 --checkpoint-dir " +
                                  tmp.file("ck2") + " --resume " + checkpoint_file(dir, 2));
  ASSERT_EQ(changed.status, 0) << changed.output;
  EXPECT_NE(changed.output.find("resume: --dtype bf16 -> f32"), std::string::npos) << changed.output;
}

// --keep-best: each evaluation that beats the run's earlier ones saves its step and names it in 'best'; retention
// (--keep-checkpoints) never removes it; it needs --checkpoint-dir and --val-data (one line each).
TEST(LoomTrainCheckpoints, KeepBestSurvivesRetention) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp), val = small_vocab_shard(tmp, "val.bin");
  const std::string dir = tmp.file("ck");
  const std::string base = "--train-data " + shard + " --model d2 -b 2 -t 16 --warmup 1 --sample-tokens 0 " +
                           "--eval-batches 1 ";
  AppRun r = run_loom_train(base + "--steps 6 --lr 3e-3 --eval-interval 1 --keep-best --keep-checkpoints 1 " +
                            "--val-data " + val + " --checkpoint-dir " + dir);
  ASSERT_EQ(r.status, 0) << r.output;
  // The best step, from the printed losses.
  double best = 1e30;
  int best_step = -1;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    int step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d: val loss %lf", &step, &loss) == 2 && step > 0 && loss < best) {
      best = loss;
      best_step = step;
    }
  }
  ASSERT_GT(best_step, 0) << r.output;
  const std::string best_file = test::read_all(dir + "/best");
  const std::string name = checkpoint_file(dir, best_step).substr(dir.size() + 1);
  EXPECT_EQ(best_file.substr(0, best_file.find('\n')), name) << best_file;
  EXPECT_NE(best_file.find("val loss "), std::string::npos) << best_file;
  EXPECT_TRUE(std::filesystem::exists(checkpoint_file(dir, best_step))) << r.output;
  EXPECT_TRUE(std::filesystem::exists(checkpoint_file(dir, 6))) << r.output;  // the latest
  size_t checkpoints = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    checkpoints += e.path().filename().string().rfind("step_", 0) == 0;
  EXPECT_EQ(checkpoints, best_step == 6 ? 1u : 2u) << r.output;

  for (const auto& [args, part] : {std::pair{"--steps 2 --keep-best --checkpoint-dir " + tmp.file("a"), "--val-data"},
                                   std::pair{"--steps 2 --keep-best --val-data " + val, "--checkpoint-dir"}}) {
    AppRun bad = run_loom_train(base + args);
    EXPECT_EQ(WEXITSTATUS(bad.status), 1) << bad.output;
    EXPECT_NE(bad.output.find(std::string("--keep-best")), std::string::npos) << bad.output;
    EXPECT_NE(bad.output.find(part), std::string::npos) << bad.output;
    EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << bad.output;
  }
}

// An llm.c model file as --init-from gives the model its shapes; with --model they are checked.
TEST(LoomTrainStart, LlmcInitFromBuildsTheModelFromItsHeader) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  nn::ModelConfig cfg = nn::ModelConfig::from_json(
      R"({"family": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 48, "vocab_size": 500, "max_seq_len": 64})");
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  const std::string bin = tmp.file("model.bin");
  io::save_llmc_model(bin, *model);
  AppRun r = run_loom_train("--train-data " + shard + " -b 2 -t 16 --eval-only --eval-batches 2 --init-from " + bin);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("model: " + io::llmc_read_config(bin).describe()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3 layers"), std::string::npos) << r.output;
  AppRun wrong = run_loom_train("--train-data " + shard + " -b 2 -t 16 --eval-only --model d2 --init-from " + bin);
  EXPECT_EQ(WEXITSTATUS(wrong.status), 1) << wrong.output;
  EXPECT_NE(wrong.output.find("llm.c"), std::string::npos) << wrong.output;
}

// --eval-only: the loss of the given weights over --eval-batches, the same whether they come from --resume or
// --init-from, perplexity = exp(loss), no step trained and nothing written. Without --val-data it says it is the
// training data's loss, here and in a training run's eval lines and logs.
TEST(LoomTrainStart, EvalOnlyAndTheTrainDataLossIsNamedSo) {
  namespace fs = std::filesystem;
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string dir = tmp.file("ck");
  AppRun train = run_loom_train("--train-data " + shard + " --model d2 -b 2 -t 16 --steps 3 --warmup 1 " +
                                "--sample-tokens 0 --eval-interval 2 --eval-batches 2 --checkpoint-dir " + dir +
                                " --log-dir " + tmp.file("logs"));
  ASSERT_EQ(train.status, 0) << train.output;
  EXPECT_NE(train.output.find("step 2: train-data loss (no --val-data)"), std::string::npos) << train.output;
  EXPECT_EQ(train.output.find("val loss"), std::string::npos) << train.output;
  const std::string metrics = test::read_all((fs::path(tmp.file("logs")) / "metrics.jsonl").string());
  EXPECT_NE(metrics.find("\"train_data/loss\""), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find("\"val/loss\""), std::string::npos) << metrics;

  const auto before = files_of(dir);
  AppRun a = run_loom_train("--train-data " + shard + " -b 2 -t 16 --eval-only --eval-batches 3 --resume " + dir +
                            " --checkpoint-dir " + dir);
  AppRun b = run_loom_train("--train-data " + shard + " --model d2 -b 2 -t 16 --eval-only --eval-batches 3 " +
                            "--init-from " + checkpoint_file(dir, 3));
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  double la = 0, lb = 0, pa = 0;
  const size_t ia = a.output.find("eval: loss"), ib = b.output.find("eval: loss");
  ASSERT_NE(ia, std::string::npos) << a.output;
  ASSERT_NE(ib, std::string::npos) << b.output;
  ASSERT_EQ(std::sscanf(a.output.c_str() + ia, "eval: loss %lf | perplexity %lf", &la, &pa), 2) << a.output;
  ASSERT_EQ(std::sscanf(b.output.c_str() + ib, "eval: loss %lf", &lb), 1) << b.output;
  EXPECT_EQ(la, lb) << "the same weights gave two losses";
  EXPECT_NEAR(pa, std::exp(la), 1e-3 * std::exp(la));
  EXPECT_NE(a.output.find("3 batch(es) of 2 x 16 tokens of the training data"), std::string::npos) << a.output;
  EXPECT_EQ(step_lines(a.output).size(), 0u) << a.output;
  EXPECT_EQ(files_of(dir), before) << "--eval-only wrote into the checkpoint directory";
  AppRun none = run_loom_train("--train-data " + shard + " --model d2 --eval-only");
  EXPECT_EQ(WEXITSTATUS(none.status), 1) << none.output;
  EXPECT_NE(none.output.find("--eval-only"), std::string::npos) << none.output;
}

// Every numeric flag's bad value is one line naming the flag (no CLI11 range with a 300-digit number, no second
// "Run with --help" line).
TEST(LoomTrainStart, EveryBadNumberIsOneLine) {
  const char* cases[] = {"--steps 0", "--steps -3", "--batch-size 0", "--seq-len 0", "--lr -1", "--lr 1e400",
                         "--lr nan", "--warmup -1", "--final-lr-fraction 2", "--weight-decay -0.5", "--beta1 1.5",
                         "--beta2 nan", "--eps -1", "--eval-interval -1", "--sample-interval -2", "--tp 0",
                         "--pp 0", "--zero 7", "--bucket-mb 0", "--peak-tflops -1", "--keep-checkpoints -1",
                         "--schedule-steps -1", "--total-batch-tokens -1", "--steps abc", "--tf32 maybe",
                         "--decay cosin"};
  for (const char* c : cases) {
    AppRun r = run_loom_train(std::string("--train-data /nonexistent/shard.bin ") + c);
    const std::string flag = std::string(c).substr(0, std::string(c).find(' '));
    EXPECT_NE(r.status, 0) << c << "\n" << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << c << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << c << "\n" << r.output;
    EXPECT_EQ(r.output.find("nonexistent"), std::string::npos) << c << " got past the flags\n" << r.output;
    EXPECT_EQ(r.output.find("0000000000"), std::string::npos) << c << "\n" << r.output;
  }
}

// --help (on stdout, status 0) names every model and dtype spelling and shows the defaults; built-in model names
// take any case (llm.c's gpt2-124M).
TEST(LoomTrainStart, HelpNamesEveryModelAndDtype) {
  FILE* p = popen((std::string(LOOM_TRAIN_EXE) + " --help 2>/dev/null").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string help;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) help.append(buf.data(), n);
  EXPECT_EQ(pclose(p), 0);
  for (const char* word : {"gpt2 ", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1558m", "gpt2-medium", "gpt2-large",
                           "gpt2-xl", "gpt2-tiny", "llama3-tiny", "llama3-1b", "llama3-3b", "llama3.2-3b", "llama3-8b", "d<N>", "JSON",
                           "Hugging Face", "gpt2-124M", "float32", "bfloat16", "float16", "half", "fp16",
                           // the defaults, however this CLI11 prints them ("=d4" here, "[d4]" in later versions)
                           "d4", "0.0006", "cosine", "--config", "--keep-checkpoints", "--eps", "--tf32", "--eval-only",
                           "--schedule-steps"})
    EXPECT_NE(help.find(word), std::string::npos) << word << "\n" << help;
  const nn::ModelConfig want = nn::ModelConfig::from_name("gpt2-124m");
  EXPECT_EQ(nn::ModelConfig::from_name("gpt2-124M").to_json(), want.to_json());
  EXPECT_EQ(nn::ModelConfig::from_name("GPT2").to_json(), want.to_json());
  EXPECT_EQ(nn::ModelConfig::from_name("GPT2-Tiny").to_json(), nn::ModelConfig::from_name("gpt2-tiny").to_json());
  EXPECT_EQ(nn::ModelConfig::from_name("LLaMA3-tiny").to_json(), nn::ModelConfig::from_name("llama3-tiny").to_json());
  EXPECT_THROW(nn::ModelConfig::from_name("gpt2-125m"), Error);
}

// --config FILE (JSON or TOML) holds flags by their long names; the command line overrides it; an unknown key is one
// error naming it.
TEST(LoomTrainStart, ConfigFileFlagsWithTheCommandLineOverriding) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string json = tmp.file("run.json"), toml = tmp.file("run.toml"), bad = tmp.file("bad.json");
  std::ofstream(json) << R"({"model": "d2", "batch-size": 2, "seq-len": 16, "steps": 3, "lr": 2e-3, "warmup": 1,
    "decay": "constant", "sample-tokens": 0, "eval-interval": 0, "shuffle": true, "train-data": ")" << shard << "\"}";
  std::ofstream(toml) << "model = \"d2\"\nbatch-size = 2\nseq-len = 16\nsteps = 3\nlr = 2e-3\nwarmup = 1\n"
                      << "decay = \"constant\"\nsample-tokens = 0\neval-interval = 0\nshuffle = true\n"
                      << "train-data = \"" << shard << "\"\n";
  AppRun j = run_loom_train("--config " + json + " --steps 2");
  ASSERT_EQ(j.status, 0) << j.output;
  auto lines = step_lines(j.output);
  EXPECT_EQ(lines.size(), 2u) << "--steps 2 on the command line did not win\n" << j.output;
  EXPECT_NE(lines[2].find("lr 2.00e-03"), std::string::npos) << j.output;
  EXPECT_NE(j.output.find("2 layers"), std::string::npos) << j.output;
  AppRun t = run_loom_train("--config " + toml + " --steps 2");
  ASSERT_EQ(t.status, 0) << t.output;
  EXPECT_EQ(step_lines(t.output), lines) << "TOML and JSON configs ran differently\n" << t.output;
  std::ofstream(bad) << R"({"model": "d2", "learning-rate": 0.1})";
  AppRun u = run_loom_train("--config " + bad + " --train-data " + shard);
  EXPECT_NE(u.status, 0) << u.output;
  EXPECT_NE(u.output.find("learning-rate"), std::string::npos) << u.output;
  EXPECT_EQ(std::count(u.output.begin(), u.output.end(), '\n'), 1) << u.output;
}

// loom-train refuses `args` at start-up: exit status 1, one line holding every one of `parts`, and the data file
// (a path under /nonexistent) never opened.
void expect_refused_at_start(const std::string& args, const std::vector<std::string>& parts) {
  AppRun r = run_loom_train(args);
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << args << "\n" << r.output;
  for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << args << "\n" << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << "\n" << r.output;
  EXPECT_EQ(r.output.find("nonexistent"), std::string::npos) << args << " opened the data first\n" << r.output;
}

// A layout that cannot be, from the flags or the [parallelism] section of a config file, is one line naming every
// problem, said before the data is opened or anything is allocated.
TEST(LoomTrainStart, ImpossibleLayoutsAreOneLineBeforeTheData) {
  test::TempDir tmp;
  const std::string toml = tmp.file("run.toml");
  std::ofstream(toml) << "[model]\nmodel = \"d2\"\n[training]\ntrain-data = \"/nonexistent/shard.bin\"\n"
                      << "[parallelism]\nsp = true\nzero = 3\n";
  const struct {
    std::string args;
    std::vector<std::string> parts;
  } cases[] = {
      {"--model d2 --train-data /nonexistent/shard.bin --tp 3", {"parallelism: --tp 3 x --pp 1 does not divide the "
                                                                 "world of 1 ranks"}},
      {"--model d2 --train-data /nonexistent/shard.bin --pp 2 --tp 2", {"--tp 2 x --pp 2 does not divide"}},
      {"--config " + toml, {"--sp splits the sequence over the tensor-parallel ranks", "--sp does not combine with "
                            "--zero 3"}},
  };
  for (const auto& c : cases) expect_refused_at_start(c.args, c.parts);
  // Under mpirun every rank finds the same problem; it is said once, and the launch fails.
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0 || !distributed::mpi_available()) return;
  AppRun two = run_loom_train_with("OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 ",
                                   "--model d2 --train-data /nonexistent/shard.bin --tp 3");
  EXPECT_NE(two.status, 0) << two.output;
  const std::string said = "--tp 3 x --pp 1 does not divide the world of 2 ranks";
  const size_t first = two.output.find(said);
  ASSERT_NE(first, std::string::npos) << two.output;
  EXPECT_EQ(two.output.find(said, first + 1), std::string::npos) << "said by more than one rank\n" << two.output;
}

// --cuda-graph where it cannot capture the step yet: one line naming the option and why, and a non-zero exit, before
// the data is read or a device is used.
TEST(LoomTrainStart, CudaGraphRefusalsAreOneLine) {
  const std::string common = "--model d2 --train-data /nonexistent/shard.bin --cuda-graph ";
  const struct {
    std::string args;
    std::vector<std::string> parts;
  } cases[] = {
      {common + "--device cpu", {"--cuda-graph", "needs --device cuda"}},
      {common + "--device cuda --phase-times", {"--cuda-graph", "--phase-times", "reads the device mid-step"}},
      {common + "--device cuda --zero 1", {"--cuda-graph", "runs one process", "--zero"}},
      {common + "--device cuda --trace-ops /nonexistent/trace.json", {"--cuda-graph", "--trace-ops"}},
      {"--model mixtral-tiny --train-data /nonexistent/shard.bin --cuda-graph --device cuda",
       {"--cuda-graph", "mixture of experts"}},
  };
  for (const auto& c : cases) expect_refused_at_start(c.args, c.parts);
}

// --keep-checkpoints N: after each save only the newest N remain (with their optimizer files), single files and
// sharded directories alike.
TEST(LoomTrainStart, KeepCheckpointsRemovesTheOlderOnes) {
  namespace fs = std::filesystem;
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  for (const char* format : {"single", "sharded"}) {
    const fs::path dir = tmp.path() / format;
    AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --steps 5 --warmup 1 " +
                              "--sample-tokens 0 --eval-interval 0 --checkpoint-interval 1 --keep-checkpoints 2 " +
                              "--checkpoint-format " + format + " --checkpoint-dir " + dir.string());
    ASSERT_EQ(r.status, 0) << r.output;
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    const std::set<std::string> want =
        std::string(format) == "single"
            ? std::set<std::string>{"latest", "step_000004.safetensors", "step_000005.safetensors"}
            : std::set<std::string>{"latest", "step_000004", "step_000005"};
    EXPECT_EQ(names, want) << format << "\n" << r.output;
    EXPECT_NE(r.output.find("removed old checkpoint"), std::string::npos) << r.output;
  }
}

// --eps and --tf32 reach the run: with a huge eps AdamW's updates vanish, so the losses follow those of a run with
// learning rate 0, while the same run with the default eps moves away from them; --tf32 on/off are taken.
TEST(LoomTrainStart, EpsAndTf32) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string common = "--train-data " + shard + " --model d2 -b 2 -t 16 --steps 5 --warmup 0 --decay constant " +
                             "--weight-decay 0 --sample-tokens 0 --eval-interval 0 --seed 3 ";
  // Five steps: the default eps's run must leave the still run's losses by 1e-2 at some step; after two updates
  // alone it moved only 0.008 on one fresh shard (tests run under load, on shards drawn anew each time).
  AppRun still = run_loom_train(common + "--lr 0");
  // lr 3e-2: Adam's first steps move every weight by about lr, so the default eps's run leaves the still run's losses
  // clearly (at 3e-3 it moved step 3's loss by 0.0099 on one of CI's fresh shards, under the 1e-2 asked below).
  AppRun normal = run_loom_train(common + "--lr 3e-2 --tf32 on");
  AppRun damped = run_loom_train(common + "--lr 3e-2 --eps 1e6 --tf32 off");
  ASSERT_EQ(still.status, 0) << still.output;
  ASSERT_EQ(normal.status, 0) << normal.output;
  ASSERT_EQ(damped.status, 0) << damped.output;
  auto loss_at = [](const std::string& output, int64_t step) {
    const std::string line = step_lines(output).at(step);
    return std::stod(line.substr(line.find("loss") + 5));
  };
  double moved = 0;
  for (int64_t step = 2; step <= 5; ++step) {
    EXPECT_LE(std::abs(loss_at(damped.output, step) - loss_at(still.output, step)), 1e-4)
        << "step " << step << "\n" << damped.output << still.output;
    moved = std::max(moved, std::abs(loss_at(normal.output, step) - loss_at(still.output, step)));
  }
  EXPECT_GT(moved, 1e-2) << normal.output << still.output;
}

// --explain-kernels lists only the dtypes the run called: an f32 CPU run lists no bf16 or f16 kernel and
// gemm for f32 only (the loss is summed in f64: copy for f64 is listed).
TEST(LoomTrainStart, ExplainKernelsListsOnlyTheDtypesUsed) {
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  AppRun r = run_loom_train("--train-data " + shard + " --model d2 -b 1 -t 8 --steps 1 --warmup 0 --sample-tokens 0 " +
                            "--eval-interval 0 --explain-kernels");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("gemm on cpu for f32:"), std::string::npos) << r.output;
  for (const char* dt : {"for bf16:", "for f16:", "gemm on cpu for f64:", "gemm on cpu for i32:"})
    EXPECT_EQ(r.output.find(dt), std::string::npos) << dt << "\n" << r.output;
}
// loom-run: --help on stdout; torchrun's --nnodes/--node-rank/--master-port give this node's ranks their global RANK
// and WORLD_SIZE; a CPU loom-train run is started under mpirun (its ranks join over MPI) and runs as 2 ranks.
TEST(LoomRun, TorchrunFlagsAndCpuRuns) {
  namespace fs = std::filesystem;
  const std::string run = (fs::path(LOOM_TRAIN_EXE).parent_path() / "loom-run").string();
  if (!fs::exists(run)) GTEST_SKIP() << "no loom-run beside loom-train";
  FILE* p = popen((run + " --help 2>/dev/null").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string help;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) help.append(buf.data(), n);
  EXPECT_EQ(pclose(p), 0);
  for (const char* flag : {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                           "--standalone", "mpirun"})
    EXPECT_NE(help.find(flag), std::string::npos) << flag << "\n" << help;

  AppRun vars = run_loom_train_with("", "--nnodes 2 --node_rank 1 --nproc-per-node 2 --master-addr 10.1.2.3 "
                                        "--master-port=4321 sh -c 'echo vars $RANK $WORLD_SIZE $LOCAL_RANK "
                                        "$MASTER_ADDR $MASTER_PORT'", run);
  ASSERT_EQ(vars.status, 0) << vars.output;
  EXPECT_NE(vars.output.find("[rank 2] vars 2 4 0 10.1.2.3 4321"), std::string::npos) << vars.output;
  EXPECT_NE(vars.output.find("[rank 3] vars 3 4 1 10.1.2.3 4321"), std::string::npos) << vars.output;
  AppRun standalone = run_loom_train_with("", "--standalone --nproc-per-node 1 sh -c 'echo port $MASTER_PORT'", run);
  ASSERT_EQ(standalone.status, 0) << standalone.output;
  EXPECT_NE(standalone.output.find("[rank 0] port "), std::string::npos) << standalone.output;
  for (const char* bad : {"--nproc-per-node 0 true", "--nnodes 2 --node-rank 2 --nproc-per-node 1 true",
                          "--standalone --nnodes 2 --nproc-per-node 1 true", "--frobnicate 1 true"}) {
    AppRun r = run_loom_train_with("", bad, run);
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << bad << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << bad << "\n" << r.output;
  }

  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  if (!distributed::mpi_available()) GTEST_SKIP() << "this Loom was built without MPI (LOOM_MPI=OFF)";
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  AppRun cpu = run_loom_train_with("OMP_NUM_THREADS=1 ", "--nproc-per-node 2 " + std::string(LOOM_TRAIN_EXE) +
                                                             " --device cpu --train-data " + shard +
                                                             " --model d2 -b 1 -t 8 --steps 2 --warmup 0 "
                                                             "--sample-tokens 0 --eval-interval 0", run);
  ASSERT_EQ(cpu.status, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("world 2"), std::string::npos) << "not 2 ranks\n" << cpu.output;
  EXPECT_NE(cpu.output.find("step     2/2"), std::string::npos) << cpu.output;
}

// --eval-batches N counts the world's batches: two data-parallel processes evaluate the batches one process does
// (each took N of its own, and the printed loss depended on the process count).
TEST(LoomRun, EvalBatchesCountTheWorldsBatches) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  if (!distributed::mpi_available()) GTEST_SKIP() << "this Loom was built without MPI (LOOM_MPI=OFF)";
  test::TempDir tmp;
  const std::string shard = small_vocab_shard(tmp);
  const std::string args = "--train-data " + shard + " --model d2 -b 2 -t 8 --steps 1 --sample-tokens 0 "
                           "--eval-interval 1 --seed 3 ";
  auto val_losses = [](const std::string& out) {
    std::vector<std::string> v;
    for (size_t at = out.find("train-data loss"); at != std::string::npos; at = out.find("train-data loss", at + 1))
      v.push_back(out.substr(at, out.find('\n', at) - at));
    return v;
  };
  for (const char* batches : {"3", "4"}) {
    AppRun one = run_loom_train_with("", args + "--eval-batches " + batches);
    ASSERT_EQ(one.status, 0) << one.output;
    AppRun two = run_loom_train_with("OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 ",
                                     args + "--eval-batches " + batches);
    ASSERT_EQ(two.status, 0) << two.output;
    ASSERT_EQ(val_losses(one.output).size(), 2u) << one.output;
    ASSERT_EQ(val_losses(two.output).size(), 2u) << two.output;
    // Step 0, the same weights on the same batches, summed in another order: equal to the printed digits. (Step 1
    // differs: two processes trained on twice the tokens.)
    EXPECT_EQ(val_losses(two.output)[0], val_losses(one.output)[0]) << one.output << two.output;
  }
}

// tools/plot_loss.py draws a run without --val-data (train_data/loss) with the standard library alone, and asking
// for matplotlib where it is missing is one line saying how to get it, not a traceback.
TEST(PlotLoss, TrainDataLossAndNoMatplotlib) {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  test::TempDir tmp;
  const std::string metrics = tmp.file("metrics.jsonl");
  std::ofstream(metrics) << R"({"step": 1, "train/loss": 5.0})" << "\n"
                         << R"({"step": 2, "train/loss": 4.5})" << "\n"
                         << R"({"step": 2, "train_data/loss": 4.25})" << "\n";
  const std::string script = std::string(LOOM_SOURCE_DIR) + "/tools/plot_loss.py";
  AppRun r = run_loom_train_with("", metrics + " -o " + tmp.file("loss.png") + " --backend builtin", "python3 " + script);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("train data (eval) 4.2500 at step 2"), std::string::npos) << r.output;
  EXPECT_EQ(test::read_all(tmp.file("loss.png")).substr(1, 3), "PNG");
  if (std::system("python3 -c 'import matplotlib' > /dev/null 2>&1") == 0) GTEST_SKIP() << "matplotlib is installed";
  AppRun m = run_loom_train_with("", metrics + " --backend matplotlib", "python3 " + script);
  EXPECT_EQ(WEXITSTATUS(m.status), 1) << m.output;
  EXPECT_NE(m.output.find("pip install matplotlib"), std::string::npos) << m.output;
  EXPECT_EQ(m.output.find("Traceback"), std::string::npos) << m.output;
}

// Several runs on one plot (bf16 beside FP8, say): each after the first is compared with it step by step, the
// warm-up left out of the largest difference; a --label count that does not match is one line.
TEST(PlotLoss, SeveralRunsAreComparedWithTheFirst) {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  test::TempDir tmp;
  const std::string a = tmp.file("a.jsonl"), b = tmp.file("b.jsonl");
  std::ofstream(a) << R"({"step": 1, "train/loss": 10.0})" << "\n" << R"({"step": 2, "train/loss": 8.0})" << "\n"
                   << R"({"step": 3, "train/loss": 5.0})" << "\n";
  std::ofstream(b) << R"({"step": 1, "train/loss": 12.0})" << "\n" << R"({"step": 2, "train/loss": 8.2})" << "\n"
                   << R"({"step": 3, "train/loss": 5.05})" << "\n" << R"({"step": 4, "train/loss": 4.0})" << "\n";
  const std::string script = "python3 " + std::string(LOOM_SOURCE_DIR) + "/tools/plot_loss.py";
  AppRun r = run_loom_train_with("", a + " " + b + " --label bf16 --label fp8 --warmup 1 --backend builtin -o " +
                                         tmp.file("both.png"), script);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("bf16: train 5.0000 at step 3; fp8: train 4.0000 at step 4"), std::string::npos) << r.output;
  // Step 1 (20%) is warm-up: the largest after it is step 2's 2.5%; the last shared step is 3 (1%).
  EXPECT_NE(r.output.find("fp8 against bf16: largest relative difference after step 1 2.50% (step 2), at the last "
                          "shared step 3 1.00% (5.0500 against 5.0000)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(test::read_all(tmp.file("both.png")).substr(1, 3), "PNG");
  // Means of 2 steps after the warm-up: steps 2 and 3 only (8.2 and 5.05 against 8 and 5: +1.92%).
  AppRun w = run_loom_train_with("", a + " " + b + " --warmup 1 --window 2 --backend builtin -o " +
                                         tmp.file("w.png"), script);
  ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_NE(w.output.find("2-step means after step 1: largest +1.92% (steps 2-3), last +1.92% (steps 2-3)"),
            std::string::npos)
      << w.output;
  AppRun wide = run_loom_train_with("", a + " " + b + " --window 5 --backend builtin -o " + tmp.file("w.png"), script);
  EXPECT_NE(wide.output.find("fewer than 5 shared steps"), std::string::npos) << wide.output;
  AppRun bad = run_loom_train_with("", a + " " + b + " --label bf16 --backend builtin", script);
  EXPECT_EQ(WEXITSTATUS(bad.status), 1) << bad.output;
  EXPECT_NE(bad.output.find("1 --label for 2 metrics files"), std::string::npos) << bad.output;
}

// Runs sharing a label are repeats of one recipe: the first label's runs are the reference, their own spread is
// printed, and each other group's mean is compared with the reference mean window by window, counting the windows
// where it leaves the range of the reference's runs. The runs here are loom-train's printed text, not metrics.jsonl.
TEST(PlotLoss, RepeatsAreGroupsJudgedAgainstTheReferenceSpread) {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  test::TempDir tmp;
  auto printed = [&](const std::string& name, std::vector<double> losses, double val) {
    std::ofstream f(tmp.file(name));
    f << "model: gpt2: 2 layers\n";
    for (size_t i = 0; i < losses.size(); ++i)
      f << "step " << std::setw(5) << i + 1 << "/" << losses.size() << " | loss " << std::fixed << std::setprecision(4)
        << losses[i] << " | lr 1.00e-04 | norm 1.0000 |     60 ms | 500K tok/s | MFU 40% | ETA 0s | mem 1 MiB\n";
    if (val > 0) f << "step " << losses.size() << ": val loss " << val << "\n";
    return tmp.file(name);
  };
  const std::string a = printed("a.log", {4.0, 4.0, 2.0, 2.0}, 5.0), b = printed("b.log", {4.4, 4.4, 2.1, 2.1}, 5.2);
  const std::string c = printed("c.log", {3.95, 3.95, 1.9, 1.9}, 6.0), d = printed("d.log", {4.25, 4.25, 1.9, 1.9}, 0);
  const std::string script = "python3 " + std::string(LOOM_SOURCE_DIR) + "/tools/plot_loss.py";
  const std::string runs = a + " " + c + " " + b + " " + d + " --label bf16 --label fp8 --label bf16 --label fp8 ";
  AppRun r = run_loom_train_with("", runs + "--window 2 --backend builtin -o " + tmp.file("groups.png"), script);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("4 runs in 2 groups"), std::string::npos) << r.output;
  // bf16's windows: 4.0 and 4.4 (mean 4.2, each within 4.76%, 10% apart), then 2.0 and 2.1 (mean 2.05).
  EXPECT_NE(r.output.find("bf16 (2 runs), 2-step means after step 0: each run within 4.76% of their mean (steps 1-2), "
                          "the runs up to 10.00% apart; last window 2.0000 to 2.1000 (within 2.44%)"),
            std::string::npos)
      << r.output;
  // fp8's mean: 4.1 (-2.38%, inside 4.0-4.4), then 1.9 (-7.32%, below 2.0).
  EXPECT_NE(r.output.find("fp8 (2 runs) against bf16 (2 runs), 2-step means after step 0: the mean largest -7.32% "
                          "(steps 3-4), last -7.32% (steps 3-4); outside the range of bf16's runs in 1 of 2 windows, "
                          "the last included; each run's last window -7.32% -7.32%; all: -2.38 -7.32"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("last validation loss: bf16 5.1000 (5.0000 to 5.2000, 2 runs) at step 4; fp8 6.0000 at "
                          "step 4"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(test::read_all(tmp.file("groups.png")).substr(1, 3), "PNG");
  // --relative draws the window means in percent from bf16's mean; windows wider than the runs are one line.
  AppRun rel = run_loom_train_with("", runs + "--relative --window 2 --backend builtin -o " + tmp.file("rel.png"), script);
  ASSERT_EQ(rel.status, 0) << rel.output;
  EXPECT_EQ(test::read_all(tmp.file("rel.png")).substr(1, 3), "PNG");
  AppRun wide = run_loom_train_with("", runs + "--relative --window 5 --backend builtin -o " + tmp.file("w.png"), script);
  EXPECT_EQ(WEXITSTATUS(wide.status), 1) << wide.output;
  EXPECT_NE(wide.output.find("--relative: the runs share fewer than 5 train steps after step 0"), std::string::npos)
      << wide.output;
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
