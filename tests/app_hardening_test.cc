// The apps on bad inputs: one line naming what was wrong, a non-zero exit, and no file lost or changed. The library
// halves of these (JSON depth, config sizes, the input guard, policy typos) are in hardening_test.cc.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "loom/data/token_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "app_run.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

#if defined(LOOM_TRAIN_EXE) && defined(LOOM_GENERATE_EXE) && defined(LOOM_EXPORT_EXE) && \
    defined(LOOM_CONFORMANCE_EXE) && defined(LOOM_RUN_EXE)

using test::AppRun;
using test::expect_one_line_error;
using test::files_of;
AppRun run(const std::string& command) { return test::run_app(command); }

// A command-line error of an app whose parse errors CLI11 prints (with its "Run with --help" line): a non-zero exit
// and stderr naming every part.
void expect_parse_error(const std::string& command, std::initializer_list<std::string> parts) {
  SCOPED_TRACE(command);
  AppRun r = run(command);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) != 0) << r.out << r.err;
  for (const auto& p : parts) EXPECT_NE(r.err.find(p), std::string::npos) << "missing '" << p << "' in\n" << r.err;
}

std::string shard_in(const test::TempDir& dir) {
  const std::string shard = dir.file("train.bin");
  std::vector<int32_t> tokens(2048);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7919 % 50000);
  data::write_token_file(shard, tokens);
  return shard;
}

const std::string kTrain = LOOM_TRAIN_EXE, kGenerate = LOOM_GENERATE_EXE, kExport = LOOM_EXPORT_EXE,
                  kConformance = LOOM_CONFORMANCE_EXE, kRun = LOOM_RUN_EXE;

// Integers past 64 bits or negative for an unsigned option were taken as INT64_MAX / 2^64-1 (CLI11 2.1).
TEST(AppHardening, IntegersOutOfRangeAreErrorsNamingTheFlag) {
  expect_one_line_error(kTrain + " --train-data x.bin --steps 99999999999999999999", {"--steps", "out of range"});
  expect_one_line_error(kTrain + " --train-data x.bin --seed -1", {"--seed", "non-negative"});
  expect_parse_error(kGenerate + " -m x --seed -1", {"--seed"});
  expect_parse_error(kConformance + " --provider native --seed 99999999999999999999", {"--seed"});
}

// An option another one makes meaningless is an error naming both.
TEST(AppHardening, OptionsThatNeedAnotherAreErrors) {
  test::TempDir dir;
  const std::string shard = shard_in(dir);
  expect_one_line_error(kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --virtual-stages 2",
                        {"--virtual-stages", "--pp"});
  expect_one_line_error(kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --pp-schedule gpipe",
                        {"--pp-schedule", "--pp"});
  expect_one_line_error(kTrain + " --train-data " + shard + " --model d2 -b 4000000000 -t 4000000000",
                        {"-b 4000000000 x -t 4000000000"});
}

// loom-conformance: a case that does not exist, an op that does not exist, a device this build lacks: an error,
// never "every case passed".
TEST(AppHardening, ConformanceNeverPassesWithoutACase) {
  expect_parse_error(kConformance + " --provider native --op add --dtype f32 --case -1", {"--case"});
  expect_one_line_error(kConformance + " --provider native --op add --dtype f32 --case 999999 --reference none",
                        {"no case ran", "--case 999999"});
  expect_one_line_error(kConformance + " --provider native --case 0", {"--case", "--op"});
  expect_one_line_error(kConformance + " --provider native --op add,relu --dtype f32 --case 0", {"--case", "one --op"});
  expect_one_line_error(kConformance + " --provider native --op add,no_such_op --dtype f32", {"no_such_op"});
  expect_one_line_error(kConformance + " --provider native --op add,,relu --dtype f32", {"--op", "no op named ''"});
  expect_one_line_error(kConformance + " --describe no_such_op", {"no_such_op"});
  // A list runs every op named, and no other.
  const AppRun listed = run(kConformance + " --provider native --op add,relu --dtype f32 --reference none --jobs 1");
  EXPECT_EQ(listed.status, 0) << listed.out << listed.err;
  for (const char* row : {"\nadd ", "\nrelu "}) EXPECT_NE(listed.out.find(row), std::string::npos) << listed.out;
  EXPECT_EQ(listed.out.find("\nsoftmax "), std::string::npos) << listed.out;
  // So does a list of dtypes; a bad name in it is one error naming it.
  const AppRun dtypes = run(kConformance + " --provider native --op relu --dtype f64,bf16 --reference none --jobs 2");
  EXPECT_EQ(dtypes.status, 0) << dtypes.out << dtypes.err;
  std::istringstream table(dtypes.out);
  std::set<std::string> rows;
  for (std::string line, op, dtype; std::getline(table, line);)
    if (std::istringstream(line) >> op >> dtype && op == "relu") rows.insert(dtype);
  EXPECT_EQ(rows, (std::set<std::string>{"bf16", "f64"})) << dtypes.out;
  expect_one_line_error(kConformance + " --provider native --op relu --dtype f32,f33", {"--dtype", "f33"});
  expect_one_line_error(kConformance + " --list-kernels --dtype bf17", {"--dtype", "bf17"});
  expect_one_line_error(kConformance + " --provider native --op relu --dtype f32,bf16 --case 0", {"--case", "--dtype"});
#ifndef LOOM_WITH_CUDA
  expect_one_line_error(kConformance + " --provider native --device cuda --op add --dtype f32", {"cuda"});
#endif
}

// A verify cache that cannot be written is not reported as recorded; a file that is not a cache stays as it is.
TEST(AppHardening, VerifyCacheIsNeverClaimedOrClobbered) {
  test::TempDir dir;
  const std::string notes = dir.file("notes.txt");
  test::write_all(notes, "not a cache");
  const std::string args = " --provider native --op add --dtype f32 --reference none --verify --verify-cache ";
  expect_one_line_error(kConformance + args + notes, {"notes.txt", "left as it is"});
  EXPECT_EQ(test::read_all(notes), "not a cache");
  expect_one_line_error(kConformance + args + "/proc/loom_no/verified.json", {"verified.json"});
}

// Outputs onto inputs: refused, the input unchanged.
TEST(AppHardening, OutputsOntoInputsAreRefused) {
  test::TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 32;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  const std::string bin = dir.file("gpt2.bin");
  io::save_llmc_model(bin, *model);
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  fs::create_symlink(bin, dir.file("link.bin"));
  const auto before = files_of(dir.path());
  expect_one_line_error(kGenerate + " -m " + bin + " --prompt-tokens 1,2 -n 1 --dump-logits " + bin,
                        {"refusing to write", "gpt2.bin"});
  expect_one_line_error(kGenerate + " -m " + bin + " --prompt-tokens 1,2 -n 1 --dump-logits " + dir.file("link.bin"),
                        {"refusing to write", "link.bin"});
  expect_one_line_error(kExport + " --checkpoint " + bin + " --llmc " + dir.file("link.bin"), {"link.bin"});
  expect_one_line_error(kExport + " --checkpoint " + dir.file("hf") + " --hf " + dir.file("hf/model.safetensors"),
                        {"refusing to write", "model.safetensors"});
  expect_one_line_error(kExport + " --checkpoint " + dir.file("hf") + " --llmc " + dir.file("hf/model.safetensors"),
                        {"refusing to write"});
  EXPECT_EQ(files_of(dir.path()), before);
}

// loom-export --force replaces only what an export writes: other files in the target stay.
TEST(AppHardening, ExportForceKeepsOtherFiles) {
  test::TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 32;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  const std::string bin = dir.file("gpt2.bin");
  io::save_llmc_model(bin, *model);
  fs::create_directories(dir.file("out"));
  test::write_all(dir.file("out/model-00001-of-00009.safetensors"), "someone else's");
  AppRun r = run(kExport + " --checkpoint " + bin + " --hf " + dir.file("out") + " --force");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(test::read_all(dir.file("out/model-00001-of-00009.safetensors")), "someone else's");
  EXPECT_TRUE(fs::exists(dir.file("out/model.safetensors")));
}

// NaN weights: loom-generate and --eval-only refuse them naming the tensor, instead of printing text and exiting 0.
TEST(AppHardening, NonFiniteWeightsAreRefusedForInference) {
  test::TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 32;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  for (auto& [name, p] : model->named_parameters())
    if (name == "h.1.attn.c_proj.weight") static_cast<float*>(p.data())[7] = std::nanf("");
  const std::string bin = dir.file("nan.bin");
  io::save_llmc_model(bin, *model);
  expect_one_line_error(kGenerate + " -m " + bin + " --prompt-tokens 1,2 -n 2", {"h.1.attn.c_proj.weight"});
  const std::string shard = shard_in(dir);
  expect_one_line_error(kTrain + " --train-data " + shard + " --init-from " + bin +
                            " -b 1 -t 8 --eval-only --eval-batches 1 --sample-tokens 0",
                        {"h.1.attn.c_proj.weight"});
  // A model directory without weights is not evaluated with random ones.
  io::save_hf_model_dir(dir.file("hf"), *nn::make_model(cfg), {});
  fs::remove(dir.file("hf/model.safetensors"));
  expect_one_line_error(kTrain + " --train-data " + shard + " --model " + dir.file("hf") +
                            " -b 1 -t 8 --eval-only --sample-tokens 0",
                        {"--eval-only", "holds no weights"});
}

// --keep-checkpoints removes only this run's checkpoints; a fresh run into another run's directory is refused.
TEST(AppHardening, RetentionTouchesOnlyThisRun) {
  test::TempDir dir;
  const std::string shard = shard_in(dir);
  const std::string ckpt = dir.file("ckpt");
  const std::string common = kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --warmup 0 --sample-tokens 0 " +
                             "--eval-batches 1 --checkpoint-dir " + ckpt + " ";
  AppRun a = run(common + "--steps 2 --checkpoint-interval 1");
  ASSERT_EQ(a.status, 0) << a.out << a.err;
  const auto first = files_of(ckpt);
  expect_one_line_error(common + "--steps 5 --checkpoint-interval 5 --keep-checkpoints 1", {"another run's"});
  EXPECT_EQ(files_of(ckpt), first);
  // Asked to overwrite, the other run's checkpoints still stay; only this run's older ones go.
  AppRun b = run(common + "--steps 6 --checkpoint-interval 3 --keep-checkpoints 1 --overwrite-checkpoints");
  ASSERT_EQ(b.status, 0) << b.out << b.err;
  EXPECT_FALSE(fs::exists(ckpt + "/step_000003.safetensors")) << b.out;
  EXPECT_TRUE(fs::exists(ckpt + "/step_000006.safetensors")) << b.out;
  const auto after = files_of(ckpt);
  for (const auto& [path, bytes] : first)
    if (path.find("latest") == std::string::npos) EXPECT_EQ(after.at(path), bytes) << path << " changed";
}

// loom-run: a malformed MASTER_PORT is an error, not port 0.
TEST(AppHardening, LoomRunChecksTheEnvironment) {
  expect_one_line_error("MASTER_PORT=29x00 " + kRun + " --nproc-per-node 2 /bin/true", {"MASTER_PORT", "29x00"});
  expect_one_line_error("MASTER_PORT=70000 " + kRun + " --nproc-per-node 2 /bin/true", {"MASTER_PORT"});
  expect_one_line_error("ulimit -n 64 && " + kRun + " --nproc-per-node 200 /bin/true", {"--nproc-per-node 200",
                                                                                         "open-file limit"});
}

#endif

}  // namespace
}  // namespace loom
