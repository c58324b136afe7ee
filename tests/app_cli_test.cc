// The apps' command lines as a user of llm.c, nanoGPT or torchtitan meets them, run as subprocesses: config files in
// their styles, one way to name a checkpoint in every app, nothing lost unasked (log directories, resumed runs'
// checkpoints, prepared shards), --eval-batches 0 as the whole split, --version, and one-line errors that suggest the
// flag meant.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/common/error.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/token_file.h"
#include "loom/io/safetensors.h"
#include "test_files.h"
#include "test_util.h"
#include "train_output.h"

#if defined(LOOM_TRAIN_EXE) && defined(LOOM_GENERATE_EXE) && defined(LOOM_EXPORT_EXE) && defined(LOOM_PREPARE_EXE)

namespace loom {
namespace {

namespace fs = std::filesystem;

struct AppRun {
  int status = -1;  // the exit status, -1 when it did not exit
  std::string output;  // stdout and stderr
};

AppRun run_app(const std::string& exe, const std::string& args) {
  AppRun r;
  FILE* p = popen((exe + " " + args + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

AppRun train(const std::string& args) { return run_app(LOOM_TRAIN_EXE, args); }

size_t lines_of(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// --eval-only's "eval: loss L | perplexity P | N batch(es) ...": L and N.
std::pair<double, long> eval_line(const std::string& output) {
  const size_t at = output.find("eval: loss");
  double loss = -1, perplexity = 0;
  long batches = -1;
  if (at == std::string::npos ||
      std::sscanf(output.c_str() + at, "eval: loss %lf | perplexity %lf | %ld batch", &loss, &perplexity, &batches) != 3)
    return {-1, -1};
  return {loss, batches};
}

std::string read_file(const std::string& path) { return test::read_all(path); }

// ---------------------------------------------------------------- config files

TEST(AppCli, ConfigFilesInTorchtitanAndNanoGptStyles) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp, "train.bin", 8192);
  // torchtitan: sections, snake_case keys.
  std::ofstream(tmp.file("run.toml")) << "[model]\nmodel = \"d2\"\n\n[training]\ntrain_data = \"" << data
                                      << "\"\nbatch_size = 2\nseq_len = 16\nsteps = 3\nsample_tokens = 0\n"
                                      << "eval_interval = 0\nshuffle = true\n\n[optimizer]\nlr = 2e-3\nwarmup = 1\n"
                                      << "decay = \"constant\"\n\n[metrics]\nlog_interval = 1\n";
  // The same nesting in JSON.
  std::ofstream(tmp.file("run.json")) << R"({"model": {"model": "d2"}, "training": {"train_data": ")" << data
                                      << R"(", "batch_size": 2, "seq_len": 16, "steps": 3, "sample_tokens": 0,
    "eval_interval": 0, "shuffle": true}, "optimizer": {"lr": 2e-3, "warmup": 1, "decay": "constant"}})";
  // nanoGPT: a flat object of snake_case keys.
  std::ofstream(tmp.file("flat.json")) << R"({"model": "d2", "train_data": ")" << data
                                       << R"(", "batch_size": 2, "seq_len": 16, "steps": 3, "sample_tokens": 0,
    "eval_interval": 0, "shuffle": true, "lr": 2e-3, "warmup": 1, "decay": "constant"})";
  std::map<long, std::string> first;
  for (const char* file : {"run.toml", "run.json", "flat.json"}) {
    AppRun r = train("--config " + tmp.file(file) + " --steps 2");  // the command line wins over steps = 3
    ASSERT_EQ(r.status, 0) << file << "\n" << r.output;
    const auto lines = test::step_lines(r.output);
    ASSERT_EQ(lines.size(), 2u) << file << ": --steps 2 on the command line did not win\n" << r.output;
    EXPECT_NE(lines.at(2).find("lr 2.00e-03"), std::string::npos) << file << "\n" << r.output;
    EXPECT_NE(r.output.find("2 layers"), std::string::npos) << file << "\n" << r.output;
    if (first.empty()) first = lines;
    EXPECT_EQ(lines, first) << file << " ran differently from run.toml\n" << r.output;
  }

  // The shipped examples read cleanly (--help exits 0 only after the config file was read).
  for (const auto& e : fs::directory_iterator(std::string(LOOM_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".toml") continue;
    AppRun r = train("--config " + e.path().string() + " --help");
    EXPECT_EQ(r.status, 0) << e.path() << "\n" << r.output;
  }

  // Each mistake is one line naming the file and what is wrong.
  const struct {
    const char* name;
    std::string text;
    std::vector<std::string> said;
  } bad[] = {
      {"key.toml", "[optimizer]\nlearning_rate = 1e-3\n", {"unknown key 'learning_rate' in [optimizer]", "'lr'"}},
      {"section.toml", "[trainer]\nsteps = 3\n", {"unknown section [trainer]", "[training]"}},
      {"place.json", R"({"training": {"lr": 1e-3}})", {"'lr' belongs in [optimizer], not [training]"}},
      {"nano.json", R"({"batch_size": 2, "max_iters": 10})", {"unknown key 'max_iters'"}},
      {"syntax.toml", "[training]\nsteps = = 3\n", {"syntax.toml:2", "not valid TOML"}},
      {"twice.toml", "lr = 1e-3\n[optimizer]\nlr = 2e-3\n", {"'lr' is set twice"}},
      {"value.toml", "[training]\nsteps = {a = 1}\n", {"unknown section [training.steps]"}},
  };
  for (const auto& b : bad) {
    std::ofstream(tmp.file(b.name)) << b.text;
    AppRun r = train("--config " + tmp.file(b.name) + " --train-data " + data);
    EXPECT_EQ(r.status, 2) << b.name << "\n" << r.output;
    EXPECT_EQ(lines_of(r.output), 1u) << b.name << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("loom-train: error: --config " + tmp.file(b.name), 0), 0u) << b.name << "\n" << r.output;
    for (const std::string& s : b.said) EXPECT_NE(r.output.find(s), std::string::npos) << b.name << "\n" << r.output;
  }
}

// A config file's mistakes come all at once, one line each, in file order; torchtitan's own keys are taken as Loom's
// settings where they mean the same, else refused with Loom's equivalent; the command line takes --batch_size.
TEST(AppCli, ConfigErrorsTogetherAndTorchtitanKeys) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp);
  std::ofstream(tmp.file("many.toml")) << "[training]\nstepz = 3\nseq_len = 16\n[optimizer]\nlearning_rate = 1e-3\n"
                                       << "[trainer]\nsteps = 3\n";
  AppRun many = train("--config " + tmp.file("many.toml") + " --train-data " + data);
  EXPECT_EQ(many.status, 2) << many.output;
  EXPECT_EQ(lines_of(many.output), 3u) << many.output;
  const size_t a = many.output.find("many.toml:2: unknown key 'stepz'"),
               b = many.output.find("many.toml:5: unknown key 'learning_rate'"),
               c = many.output.find("many.toml:6: unknown section [trainer]");
  EXPECT_TRUE(a != std::string::npos && b != std::string::npos && c != std::string::npos && a < b && b < c)
      << many.output;
  // The same in JSON, in the file's order (not the keys' alphabetical one).
  std::ofstream(tmp.file("many.json")) << R"({"zzz": 1, "aaa": 2})";
  AppRun j = train("--config " + tmp.file("many.json") + " --train-data " + data);
  EXPECT_EQ(lines_of(j.output), 2u) << j.output;
  EXPECT_LT(j.output.find("'zzz'"), j.output.find("'aaa'")) << j.output;

  // torchtitan's keys that Loom has under another name run.
  std::ofstream(tmp.file("titan.toml")) << "[model]\nmodel = \"d2\"\n[training]\nlocal_batch_size = 2\nseq_len = 16\n"
                                        << "steps = 2\nmax_norm = 1.0\nsample_tokens = 0\neval_interval = 0\n"
                                        << "[lr_scheduler]\nwarmup_steps = 1\n[checkpoint]\nfolder = \""
                                        << tmp.file("ck") << "\"\ninterval = 1\nkeep_latest_k = 1\n"
                                        << "[metrics]\nlog_freq = 1\n";
  AppRun titan = train("--config " + tmp.file("titan.toml") + " --train-data " + data);
  ASSERT_EQ(titan.status, 0) << titan.output;
  EXPECT_EQ(test::step_lines(titan.output).size(), 2u) << titan.output;
  EXPECT_TRUE(fs::exists(tmp.file("ck/latest"))) << titan.output;
  // Those it has not: refused with what Loom has instead, every one at once.
  std::ofstream(tmp.file("titan_bad.toml")) << "[job]\ndump_folder = \"./out\"\ndescription = \"x\"\n[model]\n"
                                            << "name = \"llama3\"\nflavor = \"debugmodel\"\n[checkpoint]\nenable = true\n";
  AppRun bad = train("--config " + tmp.file("titan_bad.toml") + " --train-data " + data);
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_EQ(lines_of(bad.output), 5u) << bad.output;
  for (const char* said : {"titan_bad.toml:2: 'dump_folder' in [job] is torchtitan's", "checkpoint_dir",
                           "titan_bad.toml:5: 'name' in [model] is torchtitan's", "model = \"d12\"",
                           "titan_bad.toml:6: 'flavor'", "titan_bad.toml:8: 'enable' in [checkpoint]"})
    EXPECT_NE(bad.output.find(said), std::string::npos) << said << "\n" << bad.output;

  // --batch_size and --seq_len=16 on the command line, as in config files.
  AppRun under = train("--train-data " + data + " --model d2 --batch_size 2 --seq_len=16 --steps 1 --warmup 0 " +
                       "--sample_tokens 0 --eval_batches 1");
  ASSERT_EQ(under.status, 0) << under.output;
  EXPECT_NE(under.output.find("batch: 2 x 16 tokens"), std::string::npos) << under.output;
}

// ---------------------------------------------------------------- one way to name a checkpoint

// A run's checkpoint directory (its latest), a checkpoint file and a sharded step directory name the same weights
// in loom-train (--resume, --init-from), loom-generate and loom-export; --init-from builds the checkpoint's model.
TEST(AppCli, EveryAppTakesEveryCheckpointName) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp, "train.bin", 8192);
  const std::string common = "--train-data " + data + " -b 2 -t 16 --warmup 1 --sample-tokens 0 --eval-interval 0 ";
  for (const char* format : {"single", "sharded"}) {
    const std::string dir = tmp.file(std::string("ck_") + format);
    AppRun run = train(common + "--model d2 --steps 2 --checkpoint-interval 1 --checkpoint-format " + format +
                       " --checkpoint-dir " + dir);
    ASSERT_EQ(run.status, 0) << run.output;
    const std::string latest = dir + (std::string(format) == "single" ? "/step_000002.safetensors" : "/step_000002");
    ASSERT_TRUE(fs::exists(latest)) << run.output;
    std::string tokens, weights;
    double loss = 0;
    for (const std::string& name : {dir, latest}) {
      SCOPED_TRACE(name);
      AppRun gen = run_app(LOOM_GENERATE_EXE, "-m " + name + " --prompt-tokens 1,2,3 -n 6 --greedy");
      ASSERT_EQ(gen.status, 0) << gen.output;
      std::string out;  // the token ids (stderr's lines name the model's path)
      std::istringstream lines(gen.output);
      for (std::string line; std::getline(lines, line);)
        if (line.rfind("loom-generate:", 0) != 0) out += line + "\n";
      if (tokens.empty()) tokens = out;
      EXPECT_EQ(out, tokens) << gen.output;

      const std::string hf = tmp.file("export.safetensors");
      fs::remove(hf);
      AppRun ex = run_app(LOOM_EXPORT_EXE, "--checkpoint " + name + " --hf " + hf);
      ASSERT_EQ(ex.status, 0) << ex.output;
      if (weights.empty()) weights = read_file(hf);
      EXPECT_TRUE(read_file(hf) == weights) << "another checkpoint was exported";

      // No --model: the checkpoint's d2, not the default d4.
      AppRun ev = train(common + "--eval-only --eval-batches 2 --init-from " + name);
      ASSERT_EQ(ev.status, 0) << ev.output;
      EXPECT_NE(ev.output.find("2 layers"), std::string::npos) << "not the checkpoint's model\n" << ev.output;
      if (loss == 0) loss = eval_line(ev.output).first;
      EXPECT_EQ(eval_line(ev.output).first, loss) << ev.output;

      AppRun resumed = train(common + "--steps 3 --checkpoint-dir " + tmp.file("again") +
                             " --overwrite-checkpoints --resume " + name);
      ASSERT_EQ(resumed.status, 0) << resumed.output;
      EXPECT_NE(resumed.output.find("resumed at step 2"), std::string::npos) << resumed.output;
    }
  }
  // A directory that is no checkpoint is one line saying what it lacks, the same in every app.
  fs::create_directories(tmp.file("empty"));
  for (const auto& [exe, args] : std::vector<std::pair<std::string, std::string>>{
           {LOOM_GENERATE_EXE, "--prompt-tokens 1 -m "}, {LOOM_EXPORT_EXE, "--hf x.safetensors --checkpoint "},
           {LOOM_TRAIN_EXE, common + "--steps 3 --resume "}, {LOOM_TRAIN_EXE, common + "--steps 3 --init-from "}}) {
    AppRun r = run_app(exe, args + tmp.file("empty"));
    EXPECT_EQ(r.status, 1) << args << "\n" << r.output;
    EXPECT_EQ(lines_of(r.output), 1u) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("holds no checkpoint: no 'latest' file"), std::string::npos) << args << "\n" << r.output;
  }
}

// ---------------------------------------------------------------- nothing lost unasked

// A fresh run given an earlier run's --log-dir appends to its metrics.jsonl after a mark; a resume's mark names its
// checkpoint. tools/plot_loss.py draws the newest run (and its resumes).
TEST(AppCli, ASecondRunAppendsToTheLogDir) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp, "train.bin", 8192);
  const std::string logs = tmp.file("logs"), metrics = logs + "/metrics.jsonl";
  const std::string common = "--train-data " + data + " --model d2 -b 2 -t 16 --warmup 1 --sample-tokens 0 " +
                             "--eval-interval 0 --log-dir " + logs + " ";
  AppRun first = train(common + "--steps 3 --checkpoint-dir " + tmp.file("ck"));
  ASSERT_EQ(first.status, 0) << first.output;
  std::string before = read_file(metrics);
  AppRun resumed = train(common + "--steps 4 --resume " + tmp.file("ck"));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  ASSERT_EQ(read_file(metrics).rfind(before, 0), 0u) << "the first run's lines were not kept\n" << read_file(metrics);
  before = read_file(metrics);
  AppRun second = train(common + "--steps 2 --lr 1e-2");
  ASSERT_EQ(second.status, 0) << second.output;
  ASSERT_EQ(read_file(metrics).rfind(before, 0), 0u) << "the earlier runs' lines were not kept\n" << read_file(metrics);

  std::vector<nlohmann::json> starts;
  int losses = 0;
  std::istringstream in(read_file(metrics));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("run_start")) starts.push_back(j);
    if (j.contains("train/loss")) ++losses;
  }
  ASSERT_EQ(starts.size(), 3u) << read_file(metrics);
  EXPECT_EQ(losses, 3 + 1 + 2);
  EXPECT_EQ(starts[0].at("step"), 0);
  EXPECT_FALSE(starts[0].contains("resumed_from"));
  EXPECT_EQ(starts[1].at("step"), 3);
  EXPECT_EQ(starts[1].at("resumed_from"), tmp.file("ck") + "/step_000003.safetensors");
  EXPECT_EQ(starts[2].at("step"), 0);
  EXPECT_FALSE(starts[2].contains("resumed_from"));
  int event_files = 0;
  for (const auto& e : fs::directory_iterator(logs)) event_files += e.path().filename().string().rfind("events.", 0) == 0;
  EXPECT_EQ(event_files, 3);

  if (std::system("command -v python3 > /dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  // The newest run is the second fresh one (2 steps): merged by step, the first run's resumed step 4 would show.
  AppRun plot = run_app("python3", std::string(LOOM_SOURCE_DIR) + "/tools/plot_loss.py " + logs + " -o " +
                                       tmp.file("loss.png") + " --backend builtin");
  ASSERT_EQ(plot.status, 0) << plot.output;
  EXPECT_NE(plot.output.find("at step 2"), std::string::npos) << plot.output;
  EXPECT_EQ(plot.output.find("at step 4"), std::string::npos) << plot.output;
}

// A resume without --checkpoint-dir saves into the directory it resumed from (from the directory's latest or from a
// file in it), and says so.
TEST(AppCli, AResumeSavesWhereItResumed) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp, "train.bin", 8192);
  const std::string dir = tmp.file("ck");
  const std::string common = "--train-data " + data + " -b 2 -t 16 --warmup 1 --sample-tokens 0 --eval-interval 0 ";
  ASSERT_EQ(train(common + "--model d2 --steps 2 --checkpoint-dir " + dir).status, 0);
  AppRun from_dir = train(common + "--steps 3 --resume " + dir);
  ASSERT_EQ(from_dir.status, 0) << from_dir.output;
  EXPECT_TRUE(fs::exists(dir + "/step_000003.safetensors")) << from_dir.output;
  EXPECT_EQ(read_file(dir + "/latest"), "step_000003.safetensors\n");
  EXPECT_NE(from_dir.output.find("checkpoints: saved to " + dir), std::string::npos) << from_dir.output;
  AppRun from_file = train(common + "--steps 4 --resume " + dir + "/step_000003.safetensors");
  ASSERT_EQ(from_file.status, 0) << from_file.output;
  EXPECT_TRUE(fs::exists(dir + "/step_000004.safetensors")) << from_file.output;
  // Told otherwise, it saves there.
  AppRun elsewhere = train(common + "--steps 5 --resume " + dir + " --checkpoint-dir " + tmp.file("other"));
  ASSERT_EQ(elsewhere.status, 0) << elsewhere.output;
  EXPECT_TRUE(fs::exists(tmp.file("other") + "/step_000005.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/step_000005.safetensors"));
}

// loom-prepare refuses to write over an earlier run's shards unless --overwrite; with it, the earlier run's shards
// the new one does not write are removed (a glob of the directory would take them too).
TEST(AppCli, LoomPrepareRefusesToWriteOverShards) {
  test::TempDir tmp;
  try {
    data::GPT2Tokenizer::find_vocab_dir();
  } catch (const Error&) {
    GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh";
  }
  std::string text;
  for (int i = 0; i < 40; ++i) text += "The quick brown fox jumps over the lazy dog number " + std::to_string(i) + ".\n";
  test::write_all(tmp.file("long.txt"), text);
  test::write_all(tmp.file("short.txt"), "A short text.\n");
  const std::string out = tmp.file("shards");
  const std::string base = "--output-dir " + out + " --name t ";
  AppRun first = run_app(LOOM_PREPARE_EXE, base + "--input " + tmp.file("long.txt") + " --val-tokens 20 --shard-tokens 100");
  ASSERT_EQ(first.status, 0) << first.output;
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(out)) before[e.path().filename().string()] = read_file(e.path());
  ASSERT_GE(before.size(), 4u) << first.output;

  AppRun again = run_app(LOOM_PREPARE_EXE, base + "--input " + tmp.file("short.txt") + " --val-tokens 2");
  EXPECT_EQ(again.status, 1) << again.output;
  EXPECT_EQ(lines_of(again.output), 1u) << again.output;
  EXPECT_NE(again.output.find("loom-prepare: error: " + out + " already holds " + std::to_string(before.size())),
            std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--overwrite"), std::string::npos) << again.output;
  std::map<std::string, std::string> kept;
  for (const auto& e : fs::directory_iterator(out)) kept[e.path().filename().string()] = read_file(e.path());
  EXPECT_EQ(kept, before) << "the refused run changed the shards";

  AppRun replaced =
      run_app(LOOM_PREPARE_EXE, base + "--input " + tmp.file("short.txt") + " --val-tokens 2 --overwrite");
  ASSERT_EQ(replaced.status, 0) << replaced.output;
  std::vector<std::string> now;
  for (const auto& e : fs::directory_iterator(out)) now.push_back(e.path().filename().string());
  std::sort(now.begin(), now.end());
  EXPECT_EQ(now, (std::vector<std::string>{"t_train_000000.bin", "t_val_000000.bin"})) << replaced.output;
}

// ---------------------------------------------------------------- --eval-batches 0

TEST(AppCli, EvalBatchesZeroIsTheWholeSplit) {
  test::TempDir tmp;
  const std::string data = test::small_vocab_shard(tmp, "train.bin", 8192);
  const std::string val = test::small_vocab_shard(tmp, "val.bin", 5 * 2 * 16 + 1);  // five batches of 2 x 16
  const std::string dir = tmp.file("ck");
  const std::string common = "--train-data " + data + " -b 2 -t 16 --sample-tokens 0 ";
  ASSERT_EQ(train(common + "--model d2 --steps 1 --warmup 0 --eval-interval 0 --checkpoint-dir " + dir).status, 0);
  std::map<std::string, std::pair<double, long>> got;
  for (const char* n : {"0", "all", "5", "1000", "1"}) {
    AppRun r = train(common + "--eval-only --init-from " + dir + " --val-data " + val + " --eval-batches " + n);
    ASSERT_EQ(r.status, 0) << n << "\n" << r.output;
    got[n] = eval_line(r.output);
  }
  EXPECT_EQ(got["0"].second, 5) << "--eval-batches 0 did not evaluate the whole split";
  EXPECT_EQ(got["all"], got["0"]);
  EXPECT_EQ(got["5"], got["0"]);
  EXPECT_EQ(got["1000"], got["0"]);
  EXPECT_EQ(got["1"].second, 1);
  EXPECT_NE(got["1"].first, got["0"].first);
  // --eval-only with --val-data needs no --train-data (it was required), and evaluates the same.
  AppRun val_only = train("-b 2 -t 16 --sample-tokens 0 --eval-only --init-from " + dir + " --val-data " + val +
                          " --eval-batches 0");
  ASSERT_EQ(val_only.status, 0) << val_only.output;
  EXPECT_EQ(eval_line(val_only.output), got["0"]);
  AppRun resumed = train("-b 2 -t 16 --sample-tokens 0 --eval-only --resume " + dir + " --val-data " + val);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_EQ(eval_line(resumed.output), got["0"]);
  // In a training run too: the evaluation at the end covers the split.
  AppRun run = train(common + "--resume " + dir + " --steps 2 --checkpoint-dir " + tmp.file("ck2") + " --val-data " +
                     val + " --eval-batches 0 --log-dir " + tmp.file("logs"));
  ASSERT_EQ(run.status, 0) << run.output;
}

// ---------------------------------------------------------------- --version and errors

std::vector<std::pair<std::string, std::string>> every_app() {
  const fs::path bin = fs::path(LOOM_TRAIN_EXE).parent_path();
  return {{"loom-train", LOOM_TRAIN_EXE},
          {"loom-generate", LOOM_GENERATE_EXE},
          {"loom-export", LOOM_EXPORT_EXE},
          {"loom-prepare", LOOM_PREPARE_EXE},
          {"loom-conformance", (bin / "loom-conformance").string()},
          {"loom-run", (bin / "loom-run").string()}};
}

TEST(AppCli, VersionInEveryApp) {
  std::string commit;
  if (FILE* p = popen(("git -C " + std::string(LOOM_SOURCE_DIR) + " rev-parse --short=12 HEAD 2>/dev/null").c_str(), "r")) {
    std::array<char, 64> buf{};
    while (size_t n = fread(buf.data(), 1, buf.size(), p)) commit.append(buf.data(), n);
    pclose(p);
    while (!commit.empty() && commit.back() == '\n') commit.pop_back();
  }
  for (const auto& [name, exe] : every_app()) {
    if (!fs::exists(exe)) continue;
    AppRun r = run_app(exe, "--version");  // no other flag, though some are required
    ASSERT_EQ(r.status, 0) << name << "\n" << r.output;
    EXPECT_EQ(r.output.rfind(name + " 0.", 0), 0u) << r.output;
    EXPECT_NE(r.output.find("(commit " + (commit.empty() ? std::string("unknown") : commit)), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("\nCUDA: "), std::string::npos) << r.output;
#ifdef LOOM_WITH_CUDA
    EXPECT_NE(r.output.find("architectures "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("\ncuDNN: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("\nNCCL: "), std::string::npos) << r.output;
#endif
  }
}

// A command line an app refuses: the app, its arguments and what its one error line says.
struct RefusedLine {
  std::string app, args, said;
};

// Each case exits with status 2 and one line "APP: error: ..." containing what it should say.
void expect_one_error_line(const std::vector<RefusedLine>& cases) {
  std::map<std::string, std::string> exes;
  for (const auto& [name, exe] : every_app()) exes[name] = exe;
  for (const auto& c : cases) {
    if (!fs::exists(exes.at(c.app))) continue;
    AppRun r = run_app(exes.at(c.app), c.args);
    EXPECT_EQ(r.status, 2) << c.app << " " << c.args << "\n" << r.output;
    EXPECT_EQ(lines_of(r.output), 1u) << c.app << " " << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.rfind(c.app + ": error: ", 0), 0u) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.said), std::string::npos) << c.app << " " << c.args << "\n" << r.output;
  }
}

// An unknown flag is one line with the flag meant; every app's errors are one "APP: error: ..." line.
TEST(AppCli, UnknownFlagsGetTheNearestOneInOneLine) {
  expect_one_error_line({
      {"loom-train", "--train-data x.bin --learning-rate 1e-3", "unknown flag --learning-rate (did you mean --lr?)"},
      {"loom-train", "--train-data x.bin --stpes 3", "unknown flag --stpes (did you mean --steps?)"},
      {"loom-train", "--train-data x.bin --batch_sise 2", "(did you mean --batch-size?)"},  // --batch_size is taken
      {"loom-train", "--train-data x.bin --eval-batches=2 --frobnicate", "unknown flag --frobnicate; loom-train --help"},
      {"loom-train", "--steps 3", "--train-data is required"},
      {"loom-train", "--eval-only --init-from x", "--train-data is required (--eval-only needs it only without --val-data)"},
      {"loom-generate", "-m x --temprature 0.5", "unknown flag --temprature (did you mean --temperature?)"},
      {"loom-generate", "--prompt-tokens 1", "--model is required"},
      {"loom-export", "--chekpoint x", "(did you mean --checkpoint?)"},
      {"loom-prepare", "--inptu x", "(did you mean --input?)"},
      {"loom-conformance", "--provder native", "(did you mean --provider?)"},
      {"loom-run", "--nproc-per-nod 2 true", "(did you mean --nproc-per-node?)"},
  });
}

// A value a flag cannot take is one line naming the flag, what it takes and what it got; from a config file, the
// file, the line and the key as written (the command line's value wins and is the one named).
TEST(AppCli, BadValuesSayWhatTheFlagTakesAndWhereTheValueCameFrom) {
  test::TempDir tmp;
  std::ofstream(tmp.file("steps.toml")) << "[training]\nseq_len = 16\nsteps = \"three\"\n";
  std::ofstream(tmp.file("history.toml")) << "fp8_amax_history = 0\n";
  std::ofstream(tmp.file("graph.json")) << R"({"cuda-graph": "maybe"})";
  const std::string steps = tmp.file("steps.toml"), history = tmp.file("history.toml");
  expect_one_error_line({
      {"loom-train", "--train-data x.bin --steps x", "--steps: expected a whole number, got 'x'"},
      {"loom-train", "--train-data x.bin --steps=1.5", "--steps: expected a whole number, got '1.5'"},
      {"loom-train", "--train-data x.bin --lr fast", "--lr: expected a number, got 'fast'"},
      {"loom-train", "--train-data x.bin --lr=", "--lr: needs a value (a number)"},
      {"loom-train", "--train-data x.bin --fp8=", "--fp8: needs a value (one of {off,classifier,linear,all})"},
      {"loom-train", "--train-data x.bin --cuda-graph=maybe", "--cuda-graph: expected true or false, got 'maybe'"},
      {"loom-train", "--train-data x.bin --steps 5 --steps 6", "--steps: given 2 times; it takes one value"},
      {"loom-train", "--train-data x.bin --fp8-amax-history 0", "--fp8-amax-history: must be from 1 to 1024, got 0"},
      {"loom-train", "--train-data x.bin --config " + steps, "steps.toml:3: steps: expected a whole number, got 'three'"},
      {"loom-train", "--train-data x.bin --config " + history, "history.toml:1: fp8_amax_history: must be from 1 to 1024"},
      {"loom-train", "--train-data x.bin --config " + tmp.file("graph.json"),
       "graph.json: cuda-graph: expected true or false, got 'maybe'"},
      {"loom-train", "--train-data x.bin --config " + steps + " --steps 2 --lr q", "--lr: expected a number, got 'q'"},
      {"loom-train", "--train-data x.bin --config " + history + " --fp8-amax-history 2000",
       "error: --fp8-amax-history: must be from 1 to 1024, got 2000"},
      {"loom-generate", "-m x --max-new-tokens x", "--max-new-tokens: expected a whole number, got 'x'"},
      {"loom-generate", "-m x --temperature", "--temperature: needs a value (a number)"},
      {"loom-generate", "-m x --prompt-tokens", "--prompt-tokens: needs a value"},
      {"loom-prepare", "--input x --val-tokens -1", "--val-tokens: must be at least 0, got -1"},
      {"loom-prepare", "--input x --shard-tokens 0", "--shard-tokens: must be at least 1, got 0"},
      {"loom-conformance", "--jobs 0", "--jobs: must be at least 1, got 0"},
  });
}

}  // namespace
}  // namespace loom

#endif
