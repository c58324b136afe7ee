// Every output of every app through one writer that knows the run's inputs: a trace, a profile, a logits dump or an
// export onto an input (a shard, a config, a checkpoint, a prompt, a tokenizer, a model directory's config.json, a
// sharded checkpoint's rank file) or onto a device is refused before the work, with one line, and the file stays as
// it was. Retention removes only what this run wrote; a `latest` never leads out of its directory; an endless or
// repeated config is one line. The library halves are in reader_bounds_test.cc.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "app_run.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "test_files.h"
#include "test_util.h"
#include "train_output.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::AppRun;
using test::expect_one_line_error;
using test::files_of;
using test::run_app;
using test::TempDir;

#if defined(LOOM_TRAIN_EXE) && defined(LOOM_GENERATE_EXE) && defined(LOOM_EXPORT_EXE)

const std::string kTrain = LOOM_TRAIN_EXE, kGenerate = LOOM_GENERATE_EXE, kExport = LOOM_EXPORT_EXE;

std::string small_model_file(const TempDir& dir, const std::string& name = "gpt2.bin", int64_t context = 32) {
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = context;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  const std::string bin = dir.file(name);
  io::save_llmc_model(bin, *model);
  return bin;
}

std::string train_command(const std::string& shard) {
  return kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --warmup 0 --sample-tokens 0 --eval-batches 1 ";
}

// --trace-ops opened its path with a plain stream when training started: naming an input truncated it to 0 bytes.
TEST(AppOutputs, TraceOntoAnInputIsRefusedBeforeTraining) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), val = test::small_vocab_shard(dir, "val.bin");
  const std::string config = dir.file("run.toml"), init = small_model_file(dir, "init.bin", 1024);  // d2's context
  test::write_all(config, "seed = 3\n");
  fs::create_directories(dir.file("traces"));
  const auto before = files_of(dir.path());
  const std::string cmd = train_command(shard) + "--val-data " + val + " --config " + config + " --steps 1 ";
  for (const std::string& input : {shard, val, config})
    expect_one_line_error(cmd + "--trace-ops " + input, {"--trace-ops", "refusing to write", input});
  expect_one_line_error(cmd + "--init-from " + init + " --trace-ops " + init, {"--trace-ops", init});
  expect_one_line_error(cmd + "--trace-ops " + dir.file("traces"), {"--trace-ops", "a directory"});
  expect_one_line_error(cmd + "--trace-ops /dev/null", {"--trace-ops", "a character device"});
  expect_one_line_error(cmd + "--trace-ops " + dir.file("none/t.trace"), {"--trace-ops", "does not exist"});
  EXPECT_EQ(files_of(dir.path()), before);
}

// LOOM_PROFILE_OPS_FILE naming an input was overwritten at exit; naming a directory, nothing was written or said.
TEST(AppOutputs, ProfileFileIsCheckedLikeEveryOutput) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), bin = small_model_file(dir);
  const auto before = files_of(dir.path());
  const std::string cmd = train_command(shard) + "--steps 1";
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + shard + " " + cmd,
                        {"LOOM_PROFILE_OPS_FILE", "refusing to write", shard});
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + dir.path().string() + " " + cmd,
                        {"LOOM_PROFILE_OPS_FILE", "a directory"});
  // loom-generate: refused once its inputs are read, before it generates.
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + bin + " " + kGenerate + " -m " + bin +
                            " --prompt-tokens 1,2 -n 1",
                        {"LOOM_PROFILE_OPS_FILE", "refusing to write", bin});
  EXPECT_EQ(files_of(dir.path()), before);
  AppRun ok = run_app("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + dir.file("profile.tsv") + " " + cmd);
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_EQ(test::read_all(dir.file("profile.tsv")).rfind("op\tdevice\tdtype", 0), 0u);
}

// --dump-logits onto its own --prompt-file or --tokenizer-path overwrote it.
TEST(AppOutputs, GenerateNeverWritesOntoItsPromptOrTokenizer) {
  TempDir dir;
  const std::string bin = small_model_file(dir), prompt = dir.file("prompt.txt"), tok = dir.file("tokenizer.json");
  test::write_all(prompt, "hello");
  nlohmann::json vocab = nlohmann::json::object();
  {  // a byte-level tokenizer.json: bytes as ids 0..255 (GPT-2's printable stand-ins), <|endoftext|> as 256
    int next = 0;
    auto stand_in = [&](int b) -> std::string {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? uint32_t(b) : 256 + uint32_t(next++);
      std::string s;
      if (cp < 0x80) {
        s += char(cp);
      } else {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
      }
      return s;
    };
    for (int b = 0; b < 256; ++b) vocab[stand_in(b)] = b;
  }
  test::write_all(tok, nlohmann::json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
                                      {"added_tokens", {{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}}},
                                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"use_regex", true}}}}
                           .dump());
  const auto before = files_of(dir.path());
  const std::string cmd = kGenerate + " -m " + bin + " --prompt-file " + prompt + " --tokenizer-path " + tok + " -n 1 ";
  expect_one_line_error(cmd + "--dump-logits " + prompt, {"--dump-logits", "refusing to write", prompt});
  expect_one_line_error(cmd + "--dump-logits " + tok, {"--dump-logits", "refusing to write", tok});
  EXPECT_EQ(files_of(dir.path()), before);
  AppRun ok = run_app(cmd + "--print-tokens --dump-logits " + dir.file("logits.safetensors"));
  EXPECT_EQ(ok.status, 0) << ok.err;
  // An endless prompt is read to its bound, not to the end of memory.
  expect_one_line_error("sh -c '" + kGenerate + " -m " + bin + " -n 1 --tokenizer-path " + tok + " < /dev/zero'",
                        {"prompt on stdin", "67.1 MB"});
  expect_one_line_error(kGenerate + " -m " + bin + " -n 1 --tokenizer-path " + tok + " --prompt-file /dev/zero",
                        {"--prompt-file", "a character device"});
}

// As root a rename replaced /dev/null with a regular file; the model directory's config.json and a sharded
// checkpoint's rank files were not known as inputs.
TEST(AppOutputs, ExportNeverWritesOntoDevicesOrItsInputsFiles) {
  TempDir dir;
  const std::string bin = small_model_file(dir);
  expect_one_line_error(kExport + " --checkpoint " + bin + " --llmc /dev/null", {"--llmc", "a character device"});
  struct stat st{};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  io::save_hf_model_dir(dir.file("hf"), *io::load_model(bin), {});
  const std::string shard = test::small_vocab_shard(dir);
  AppRun sharded = run_app(train_command(shard) + "--steps 1 --checkpoint-format sharded --checkpoint-dir " +
                           dir.file("ckpt"));
  ASSERT_EQ(sharded.status, 0) << sharded.out << sharded.err;
  std::string rank_file;
  for (const auto& e : fs::directory_iterator(dir.file("ckpt/step_000001")))
    if (e.path().extension() == ".safetensors") rank_file = e.path().string();
  ASSERT_FALSE(rank_file.empty());
  const auto before = files_of(dir.path());
  expect_one_line_error(kExport + " --checkpoint " + dir.file("hf") + " --llmc " + dir.file("hf/config.json"),
                        {"--llmc", "refusing to write", "config.json"});
  expect_one_line_error(kExport + " --checkpoint " + dir.file("ckpt/step_000001") + " --llmc " + rank_file,
                        {"--llmc", "refusing to write", rank_file});
  expect_one_line_error(kExport + " --checkpoint " + dir.file("ckpt") + " --hf " + rank_file,
                        {"--hf", "refusing to write", rank_file});
  EXPECT_EQ(files_of(dir.path()), before);
}

// Resuming a checkpoint without a run id (an older Loom's) with --keep-checkpoints 1 deleted every step_* file whose
// run id could not be read, a user's file of that name included.
TEST(AppOutputs, RetentionRemovesOnlyWhatThisRunWrote) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), ckpt = dir.file("ckpt");
  const std::string cmd = train_command(shard) + "--checkpoint-dir " + ckpt + " ";
  AppRun first = run_app(cmd + "--steps 1");
  ASSERT_EQ(first.status, 0) << first.out << first.err;
  {  // as an older Loom saved it: no run id in its state
    const std::string path = ckpt + "/step_000001.safetensors";
    io::SafetensorsFile f = io::load_safetensors_file(path);
    nlohmann::json state = nlohmann::json::parse(f.metadata.at("state"));
    state.erase("run_id");
    f.metadata["state"] = state.dump();
    fs::remove(path);
    io::save_safetensors(path, f.tensors, f.metadata);
  }
  test::write_all(ckpt + "/step_000009.safetensors", "a user's file");
  test::write_all(ckpt + "/step_000002.optim-rank0.notes", "a user's notes");
  const auto kept = files_of(ckpt);
  AppRun resumed = run_app(kTrain + " --train-data " + shard + " --resume " + ckpt +
                           " --steps 4 --checkpoint-interval 1 --keep-checkpoints 1");
  ASSERT_EQ(resumed.status, 0) << resumed.out << resumed.err;
  for (const auto& [path, bytes] : kept)
    if (path.find("latest") == std::string::npos) {
      EXPECT_EQ(test::read_all(path), bytes) << path;
    }
  EXPECT_TRUE(fs::exists(ckpt + "/step_000004.safetensors"));
  EXPECT_FALSE(fs::exists(ckpt + "/step_000002.safetensors")) << resumed.out;
  EXPECT_FALSE(fs::exists(ckpt + "/step_000003.safetensors")) << resumed.out;
  EXPECT_EQ(test::read_all(ckpt + "/latest"), "step_000004.safetensors\n");
}

// --overwrite-checkpoints replaces checkpoints, not a user's file that has a checkpoint's name.
TEST(AppOutputs, OverwriteReplacesOnlyCheckpoints) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), ckpt = dir.file("ckpt");
  fs::create_directories(ckpt + "/step_000003");
  test::write_all(ckpt + "/step_000002.safetensors", "a user's file");
  test::write_all(ckpt + "/step_000003/notes.txt", "a user's notes");
  const auto before = files_of(dir.path());
  const std::string cmd = train_command(shard) + "--checkpoint-dir " + ckpt + " --overwrite-checkpoints ";
  expect_one_line_error(cmd + "--steps 2", {"--overwrite-checkpoints", "step_000002.safetensors", "not a Loom checkpoint"});
  expect_one_line_error(cmd + "--steps 3 --checkpoint-format sharded", {"step_000003", "not a Loom checkpoint"});
  EXPECT_EQ(files_of(dir.path()), before);
}

// A `latest` holding ".." escaped its directory.
TEST(AppOutputs, LatestNeverLeadsOutOfItsDirectory) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir);
  fs::create_directories(dir.file("run/ckpt"));
  for (const std::string bad : {"..", "../ckpt", "/etc"}) {
    test::write_all(dir.file("run/ckpt/latest"), bad + "\n");
    expect_one_line_error(kTrain + " --train-data " + shard + " --resume " + dir.file("run/ckpt") + " --steps 2",
                          {"--resume", "latest", "does not name a checkpoint of its directory"});
    expect_one_line_error(kExport + " --checkpoint " + dir.file("run/ckpt") + " --llmc " + dir.file("x.bin"),
                          {"--checkpoint", "latest"});
  }
}

// --config /dev/zero ended in an uncaught std::bad_alloc; a JSON config's repeated key kept the last value.
TEST(AppOutputs, ConfigsAreBoundedAndKeysGivenOnce) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir);
  expect_one_line_error(train_command(shard) + "--config /dev/zero", {"--config", "/dev/zero", "a character device"});
  expect_one_line_error(train_command(shard) + "--config " + dir.path().string(), {"--config", "a directory"});
  test::write_all(dir.file("run.json"), R"({"steps": 1, "lr": 0.001, "steps": 2})");
  expect_one_line_error(train_command(shard) + "--config " + dir.file("run.json"),
                        {"--config", "run.json", "\"steps\"", "appears twice"});
  test::write_all(dir.file("model.json"), R"({"family": "gpt2", "n_layer": 2, "n_layer": 3})");
  expect_one_line_error(kTrain + " --train-data " + shard + " -b 1 -t 8 --model " + dir.file("model.json"),
                        {"model.json", "\"n_layer\"", "twice"});
}

// A resume given only --resume and the data keeps the run: its shuffled data order and position, its schedule and
// random streams (the same losses as a run never stopped), and its log directory, appended to, not clobbered.
TEST(AppOutputs, ResumeKeepsTheRunsOrderScheduleAndLogs) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir);
  const std::string common = kTrain + " --train-data " + shard + " --model d2 -b 2 -t 8 --warmup 1 --sample-tokens 0 " +
                             "--eval-interval 0 --eval-batches 1 --shuffle --seed 5 --steps 4 --schedule-steps 4 ";
  AppRun whole = run_app(common + "--checkpoint-dir " + dir.file("whole"));
  ASSERT_EQ(whole.status, 0) << whole.err;
  AppRun first = run_app(common + "--checkpoint-dir " + dir.file("ckpt") + " --log-dir " + dir.file("logs") +
                         " --checkpoint-interval 2");
  ASSERT_EQ(first.status, 0) << first.err;
  fs::remove(dir.file("ckpt/step_000004.safetensors"));
  test::write_all(dir.file("ckpt/latest"), "step_000002.safetensors\n");
  const std::string log_before = test::read_all(dir.file("logs/metrics.jsonl"));
  AppRun resumed = run_app(kTrain + " --train-data " + shard + " --resume " + dir.file("ckpt"));
  ASSERT_EQ(resumed.status, 0) << resumed.out << resumed.err;
  const auto expected = test::step_lines(whole.out), got = test::step_lines(resumed.out);
  ASSERT_EQ(got.count(3), 1u) << resumed.out;
  EXPECT_EQ(got.at(3), expected.at(3));
  EXPECT_EQ(got.at(4), expected.at(4));
  const std::string log_after = test::read_all(dir.file("logs/metrics.jsonl"));
  EXPECT_EQ(log_after.rfind(log_before, 0), 0u) << "the earlier lines were not kept";
  EXPECT_NE(log_after.find("\"resumed_from\"", log_before.size()), std::string::npos) << log_after;
  EXPECT_NE(log_after.find("\"step\":4", log_before.size()), std::string::npos) << log_after;
  // A change of the data order would break the saved position: refused in one line.
  test::write_all(dir.file("ckpt/latest"), "step_000002.safetensors\n");
  fs::remove(dir.file("ckpt/step_000004.safetensors"));
  expect_one_line_error(kTrain + " --train-data " + shard + " --resume " + dir.file("ckpt") + " --log-interval 1 " +
                            "--seed 5 --steps 4 --shuffle=false",
                        {"--shuffle", "saved order"});
}

// An output checked before its inputs were read: a run that stopped early (a bad setting) wrote its exit profile
// over the validation shard it had not opened yet. Every file the command line names is an input from the start, and
// so is every file a pattern of --train-data names.
TEST(AppOutputs, FilesNamedOnTheCommandLineAreInputsFromTheStart) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), val = test::small_vocab_shard(dir, "val.bin");
  const std::string other = test::small_vocab_shard(dir, "train_b.bin");
  const auto before = files_of(dir.path());
  const std::string stops_early = kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --sample-tokens 0 " +
                                  "--eval-batches 1 --val-data " + val + " --steps 2 --warmup 5";
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + val + " " + stops_early,
                        {"LOOM_PROFILE_OPS_FILE", "refusing to write", val});
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + other + " " + kTrain + " --train-data '" +
                            dir.file("train*.bin") + "' --model d2 -b 1 -t 8 --steps 2 --warmup 5",
                        {"LOOM_PROFILE_OPS_FILE", "refusing to write", other});
  EXPECT_EQ(files_of(dir.path()), before);
  // The error of the run itself when the profile's file is not an input.
  expect_one_line_error("LOOM_PROFILE_OPS=1 LOOM_PROFILE_OPS_FILE=" + dir.file("p.tsv") + " " + stops_early,
                        {"--warmup 5"});
}

// loom-conformance wrote --json after the whole replay: onto its --trace, minutes of work ended in a refusal.
TEST(AppOutputs, ConformanceJsonIsCheckedBeforeTheCases) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), trace = dir.file("run.trace");
  AppRun traced = run_app(train_command(shard) + "--steps 1 --trace-ops " + trace);
  ASSERT_EQ(traced.status, 0) << traced.err;
  const auto before = files_of(dir.path());
  const std::string conformance = LOOM_CONFORMANCE_EXE;
  AppRun r = run_app(conformance + " --provider native --jobs 1 --trace " + trace + " --json " + trace);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--json: refusing to write"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("replayed"), std::string::npos) << "the cases ran before the refusal:\n" << r.out;
  test::write_all(dir.file("cases.json"), "{}");
  expect_one_line_error(conformance + " --provider native --jobs 1 --op gemm --reference pytorch --reference-file " +
                            dir.file("cases.json") + " --json " + dir.file("cases.json"),
                        {"--json", "refusing to write", "cases.json"});
  EXPECT_EQ(files_of(dir.path()).size(), before.size() + 1);
}

// A `latest` that is a link looping on itself or a directory was "no 'latest' file"; one ending in CRLF named a
// checkpoint that does not exist.
TEST(AppOutputs, LatestIsReadAsWrittenAndItsFaultsNamed) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir), ckpt = dir.file("ckpt");
  AppRun first = run_app(train_command(shard) + "--steps 1 --checkpoint-dir " + ckpt);
  ASSERT_EQ(first.status, 0) << first.err;
  test::write_all(ckpt + "/latest", "step_000001.safetensors\r\n");
  AppRun crlf = run_app(kExport + " --checkpoint " + ckpt + " --llmc " + dir.file("out.bin"));
  EXPECT_EQ(crlf.status, 0) << crlf.err;
  fs::remove(ckpt + "/latest");
  fs::create_symlink("latest", ckpt + "/latest");
  expect_one_line_error(kExport + " --checkpoint " + ckpt + " --llmc " + dir.file("x.bin"), {"latest", "symbolic links"});
  fs::remove(ckpt + "/latest");
  fs::create_directories(ckpt + "/latest");
  expect_one_line_error(kExport + " --checkpoint " + ckpt + " --llmc " + dir.file("x.bin"), {"latest", "a directory"});
}

// A default never makes a run an error: --warmup's 10 steps in a run of 3 become 3; a given --warmup past the run is
// still one. A number in a message is the number given (--top-p 1.0000001 was "got 1").
TEST(AppOutputs, DefaultsFitShortRunsAndNumbersAreSaidExactly) {
  TempDir dir;
  const std::string shard = test::small_vocab_shard(dir);
  const std::string cmd = kTrain + " --train-data " + shard + " --model d2 -b 1 -t 8 --eval-batches 1 --steps 3";
  AppRun ok = run_app(cmd);
  EXPECT_EQ(ok.status, 0) << ok.err;
  expect_one_line_error(cmd + " --warmup 4", {"--warmup 4", "--steps 3"});
  const std::string bin = small_model_file(dir);
  expect_one_line_error(kGenerate + " -m " + bin + " --prompt-tokens 1 --top-p 1.0000001", {"--top-p", "1.0000001"});
  expect_one_line_error(kGenerate + " -m " + bin + " --prompt-tokens 1 --repetition-penalty -1e-300",
                        {"--repetition-penalty", "-1e-300"});
}

#endif

}  // namespace
}  // namespace loom
