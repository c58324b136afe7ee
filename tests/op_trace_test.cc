// Op traces and call checks: a tiny training run's calls recorded (loom-train --trace-ops) replay through the
// conformance runner with every row passing on native, a planted wrong kernel is caught by the replay, a trace of
// another format version or Loom version, with an unknown op or dtype, bad shapes or malformed content is one
// error naming the file; and LOOM_CHECK_CALLS's check throws for a call that breaks its op's description.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernels/gemm_kernel.h"
#include "kernels/norm_kernel.h"
#include "loom/core/dispatch.h"
#include "loom/data/token_file.h"
#include "loom/dispatch_modes.h"
#include "loom/train/trainer.h"
#include "providers/conformance.h"
#include "providers/op_trace.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

// A tiny LLaMA-3 trained for `steps` steps on random token shards, its op calls traced into dir/run.trace.
std::string traced_run(const TempDir& dir, int steps, bool values) {
  std::mt19937 eng(3);
  std::vector<int32_t> tokens(4000);
  for (auto& t : tokens) t = int32_t(eng() % 96);
  data::write_token_file(dir.file("train_000000.bin"), tokens);
  std::ofstream(dir.file("model.json"))
      << R"({"family": "llama", "vocab_size": 96, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
            "n_embd": 32, "ffn_hidden": 64, "head_dim": 8})";
  train::TrainOptions o;
  o.model = dir.file("model.json");
  o.train_data = dir.file("train_*.bin");
  o.batch_size = 2;
  o.seq_len = 16;
  o.steps = steps;
  o.warmup_steps = 0;
  o.eval_interval = 0;
  o.eval_batches = 1;
  o.sample_tokens = 0;
  o.quiet = true;
  o.trace_ops = dir.file("run.trace");
  o.trace_values = values;
  o.trace_value_limit = 4096;
  train::Trainer(o).run();
  return o.trace_ops;
}

conformance::SuiteOptions replay_options(const std::string& provider) {
  conformance::SuiteOptions o;
  o.provider = provider;
  return o;
}

// Every call of a trace replayed for `provider`, in this process.
std::vector<conformance::CaseResult> replay(const op_trace::Trace& trace, const std::string& provider) {
  const conformance::SuiteOptions o = replay_options(provider);
  return op_trace::replay_trace(trace, o, op_trace::plan_replay(trace, o));
}

TEST(OpTrace, ATinyTrainingRunReplaysCleanOnNative) {
  TempDir dir;
  test::ScopedPolicy native_only(test::deny_all_but({"native"}));
  const std::string path = traced_run(dir, 2, false);
  EXPECT_FALSE(dispatch::op_tracing()) << "the trainer turns tracing off after its steps";
  op_trace::Trace trace = op_trace::read_trace(path);
  EXPECT_EQ(trace.loom_version, op_trace::loom_version());
  ASSERT_GT(trace.calls.size(), 10u);
  std::set<std::string> ops;
  uint64_t calls = 0;
  bool repeated = false;
  for (const auto& c : trace.calls) {
    ops.insert(c.op);
    calls += c.count;
    repeated |= c.count > 1;
  }
  // Clipping on (loom-train's default): AdamW takes the clip coefficient in its own pass.
  for (const char* op : {"gemm", "embedding", "adamw_update_scaled"}) EXPECT_TRUE(ops.count(op)) << op;
  EXPECT_TRUE(repeated) << "two steps make the same calls: identical calls are kept once with a count";
  EXPECT_GT(calls, trace.calls.size());

  auto results = replay(trace, "native");
  EXPECT_EQ(results.size(), trace.calls.size());
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "replay");
  for (const auto& r : results) EXPECT_EQ(r.status, conformance::CaseStatus::kPass) << r.op << ": " << r.detail;
}

TEST(OpTrace, RecordedValuesReplay) {
  TempDir dir;
  const std::string path = traced_run(dir, 1, true);
  ASSERT_TRUE(std::filesystem::exists(path + ".values.safetensors"));
  op_trace::Trace trace = op_trace::read_trace(path);
  size_t with_values = 0;
  for (const auto& c : trace.calls)
    for (const auto& v : c.values) with_values += !v.empty();
  EXPECT_GT(with_values, trace.calls.size() / 2);
  auto results = replay(trace, "native");
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "replay");
}

// A vendor's gemm that is right but for the first element of C: registered the way a library's kernel is
// (OpSchema::register_erased), the replay of a real run's calls fails its gemm row and no other.
TEST(OpTrace, ThePlantedWrongKernelIsCaughtByTheReplay) {
  TempDir dir;
  op_trace::Trace trace = op_trace::read_trace(traced_run(dir, 1, false));
  const OpSchema* s = find_op_schema("gemm");
  ASSERT_NE(s, nullptr);
  struct Unregister {
    ~Unregister() {
      dispatch::unregister_provider("trace_planted");
      dispatch::reset_policy();
    }
  } u;
  s->register_erased(
      kCPU, "trace_planted", dtypes(kF32), 0,
      [s](const DeviceContext&, const CallArgs& args) {
        s->run_provider("native", Device(), kF32, args);
        const Tensor& c = args.slots[size_t(s->tensor_index("c"))].tensor;
        if (c.numel() > 0 && c.dtype() == kF32) *static_cast<float*>(c.data()) += 0.5f;
      },
      nullptr, "test");
  auto results = replay(trace, "trace_planted");
  std::set<std::string> failed;
  for (const auto& r : results)
    if (r.status == conformance::CaseStatus::kFail) failed.insert(r.op);
  EXPECT_EQ(failed, std::set<std::string>{"gemm"}) << conformance::suite_table(results, "replay");
  const std::string table = conformance::suite_table(results, "loom-conformance --trace t --provider trace_planted");
  EXPECT_NE(table.find("FAIL gemm f32"), std::string::npos) << table;
  EXPECT_NE(table.find("rerun: loom-conformance --trace t --provider trace_planted --op gemm --dtype f32 --case"),
            std::string::npos)
      << table;
}

// A valid trace of one layer_norm call, to break one field at a time.
nlohmann::json one_call_trace() {
  auto t = [](std::vector<int64_t> shape, std::vector<int64_t> strides, int buffer, const char* dtype = "f32") {
    return nlohmann::json{{"dtype", dtype}, {"shape", shape}, {"strides", strides}, {"offset", 0}, {"buffer", buffer}};
  };
  return {{"format", "loom-op-trace"},
          {"format_version", 1},
          {"loom_version", op_trace::loom_version()},
          {"values", nullptr},
          {"calls",
           {{{"op", "layer_norm"},
             {"device", "cpu"},
             {"dtype", "f32"},
             {"count", 3},
             {"tensors", {t({4, 8}, {8, 1}, 0), t({8}, {1}, 1), t({8}, {1}, 2), t({4, 8}, {8, 1}, 3), t({4}, {1}, 4),
                          t({4}, {1}, 5)}},
             {"attrs", {{"eps", 1e-5}}}}}}};
}

std::string trace_error(const TempDir& dir, const nlohmann::json& j, const std::string& text = "") {
  const std::string path = dir.file("bad.trace");
  std::ofstream(path) << (text.empty() ? j.dump() : text);
  try {
    op_trace::read_trace(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(OpTrace, BadTracesAreOneErrorNamingTheFile) {
  TempDir dir;
  const auto good = one_call_trace();
  EXPECT_EQ(trace_error(dir, good), "(no error)");
  auto expect = [&](nlohmann::json j, const std::string& what, const std::string& text = "") {
    const std::string e = trace_error(dir, j, text);
    EXPECT_NE(e.find("trace '" + dir.file("bad.trace") + "'"), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << "expected '" << what << "' in: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  auto j = good;
  j["format_version"] = 2;
  expect(j, "format version 2; this Loom reads version 1");
  j = good;
  j["loom_version"] = "0.0.1";
  expect(j, "recorded by Loom 0.0.1, this is Loom " + op_trace::loom_version());
  j = good;
  j["format"] = "something-else";
  expect(j, "format 'something-else', expected 'loom-op-trace'");
  j = good;
  j["calls"][0]["op"] = "no_such_op";
  expect(j, "call 0: unknown op 'no_such_op'");
  j = good;
  j["calls"][0]["dtype"] = "f8";
  expect(j, "call 0: unknown dtype 'f8'");
  j = good;
  j["calls"][0]["tensors"][1]["dtype"] = "q4";
  expect(j, "unknown dtype 'q4'");
  j = good;
  j["calls"][0]["tensors"][1]["shape"] = {9};
  expect(j, "call 0: op layer_norm, argument 'weight' has shape [9]");
  j = good;
  j["calls"][0]["tensors"][0]["strides"] = {1};
  expect(j, "1 strides for shape [4, 8]");
  j = good;
  j["calls"][0]["tensors"].erase(5);
  expect(j, "op layer_norm takes 6 tensor arguments, the call lists 5");
  j = good;
  j["calls"][0]["attrs"]["epsilon"] = 1;
  expect(j, "op layer_norm has no attribute 'epsilon'");
  j = good;
  j["calls"][0].erase("count");
  expect(j, "call 0:");
  expect(good, "invalid JSON", "{\"format\": ");
  // Numbers are taken as the JSON numbers they are: never narrowed, wrapped or overflowed into something valid.
  j = good;
  j["format_version"] = 4294967297ull;  // 2^32 + 1 read as an int was 1
  expect(j, "format version 4294967297");
  j = good;
  j["calls"][0]["count"] = -1;  // read as uint64 was 2^64-1
  expect(j, "\"count\" must be an integer from 1");
  j = good;
  j["calls"][0]["count"] = "3";
  expect(j, "\"count\" must be an integer");
  j = good;  // an element count past int64 replayed as an empty tensor and passed
  j["calls"][0]["tensors"][0]["shape"] = {4294967296ll, 4294967296ll};
  j["calls"][0]["tensors"][0]["strides"] = {0, 0};
  expect(j, "spans more than 2^40 elements");
  j = good;
  j["calls"][0]["tensors"][0]["shape"] = {18446744073709551615ull, 8};
  expect(j, "\"shape\" must hold integers from 0 to 2^63-1");
  j = good;
  j["calls"][0]["tensors"][0]["offset"] = -4;
  expect(j, "\"offset\" must be an integer from 0");
  j = good;
  j["calls"][0]["attrs"]["eps"] = "small";
  expect(j, "attribute 'eps' must be a number, got \"small\"");
  j = good;
  j["calls"][0]["tensors"][0]["dtype"] = 7;
  expect(j, "\"dtype\" must be a string, got 7");
  j = good;  // a values file named by the trace lies beside it
  j["values"] = {{"file", "../elsewhere.safetensors"}, {"limit", 16}};
  expect(j, "must name a file beside the trace");
  expect(good, "key \"count\" appears twice",
         good.dump().replace(good.dump().find("\"count\":3"), 9, "\"count\":3,\"count\":4"));
  // A --case past the end, or a selection that matches no call, replays nothing: an error, never a pass.
  test::write_all(dir.file("one.trace"), good.dump());
  const op_trace::Trace trace = op_trace::read_trace(dir.file("one.trace"));
  auto o = replay_options("native");
  o.only_case = 5;
  test::expect_error_mentioning([&] { op_trace::plan_replay(trace, o); }, {"--case 5", "holds 1 calls"});
  o.only_case = -1;
  o.ops = {"gemm"};
  test::expect_error_mentioning([&] { op_trace::plan_replay(trace, o); }, {"no call", "nothing was replayed"});
}

#ifdef LOOM_CONFORMANCE_EXE
TEST(OpTrace, LoomConformanceRefusesABadTraceInOneLine) {
  TempDir dir;
  auto j = one_call_trace();
  j["calls"][0]["op"] = "no_such_op";
  std::ofstream(dir.file("bad.trace")) << j.dump();
  const std::string out = dir.file("out.txt");
  const std::string cmd = std::string(LOOM_CONFORMANCE_EXE) + " --provider native --trace " + dir.file("bad.trace") +
                          " > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_NE(WEXITSTATUS(status), 0);
  std::ifstream f(out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "loom-conformance: error: trace '" + dir.file("bad.trace") + "': call 0: unknown op 'no_such_op'\n");

  // The good trace replays: one row, passing.
  std::ofstream(dir.file("good.trace")) << one_call_trace().dump();
  const std::string good = std::string(LOOM_CONFORMANCE_EXE) + " --provider native --trace " +
                           dir.file("good.trace") + " > " + out + " 2>&1";
  EXPECT_EQ(WEXITSTATUS(std::system(good.c_str())), 0);
  std::ifstream g(out);
  std::string replay((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>());
  EXPECT_NE(replay.find("layer_norm"), std::string::npos) << replay;
  EXPECT_NE(replay.find("pass 1/1"), std::string::npos) << replay;
}

// --max-calls keeps the most frequent call of each op and dtype first, the same calls every time, and says which it
// left out; over workers the table is the one process's, with a progress line per call.
TEST(OpTrace, MaxCallsChoosesTheSameCallsAndWorkersGiveTheSameTable) {
  TempDir dir;
  const std::string path = traced_run(dir, 2, false);
  const op_trace::Trace trace = op_trace::read_trace(path);
  const conformance::SuiteOptions o = replay_options("native");
  std::set<std::pair<std::string, DType>> rows, kept;
  for (const auto& c : trace.calls) rows.insert({c.op, c.dtype});
  const size_t limit = rows.size() + 2;
  ASSERT_LT(limit, trace.calls.size());
  const op_trace::ReplayPlan plan = op_trace::plan_replay(trace, o, limit);
  EXPECT_EQ(plan.calls.size(), limit);
  EXPECT_EQ(plan.calls.size() + plan.left_out.size(), trace.calls.size());
  for (size_t i : plan.calls) kept.insert({trace.calls[i].op, trace.calls[i].dtype});
  EXPECT_EQ(kept, rows) << "every op and dtype keeps a call";
  EXPECT_EQ(op_trace::plan_replay(trace, o, limit).calls, plan.calls);
  EXPECT_GT(op_trace::replay_seconds(plan, plan.calls, 2), 0);

  auto run = [&](const std::string& args, std::string* err) {
    const std::string out = dir.file("out.txt"), errs = dir.file("err.txt");
    const std::string cmd = std::string(LOOM_CONFORMANCE_EXE) + " --provider native --trace " + path + " " + args +
                            " > " + out + " 2> " + errs;
    const int status = std::system(cmd.c_str());
    EXPECT_EQ(WEXITSTATUS(status), 0) << cmd << "\n" << test::read_all(errs);
    *err = test::read_all(errs);
    return test::read_all(out);
  };
  std::string err_one, err_many;
  const std::string one = run("--max-calls " + std::to_string(limit) + " --jobs 1", &err_one);
  const std::string many = run("--max-calls " + std::to_string(limit) + " --jobs 2 --json " + dir.file("r.json"),
                                &err_many);
  EXPECT_EQ(one, many);
  // --json holds one result per replayed call.
  const nlohmann::json report = nlohmann::json::parse(test::read_all(dir.file("r.json")));
  EXPECT_EQ(report.at("results").size(), limit);
  EXPECT_NE(one.find("left out by --max-calls " + std::to_string(limit) + ": "), std::string::npos) << one;
  for (const std::string& err : {err_one, err_many}) {
    EXPECT_NE(err.find("call 1 of " + std::to_string(limit) + " (#"), std::string::npos) << err;
    EXPECT_NE(err.find("--max-calls " + std::to_string(limit) + " left out " +
                       std::to_string(trace.calls.size() - limit) + " of "),
              std::string::npos)
        << err;
  }
  // A budget the trace cannot keep is said before the replay, with a --max-calls that keeps it.
  std::string err_budget;
  run("--budget 0.0001 --jobs 1", &err_budget);
  EXPECT_NE(err_budget.find("over the budget of"), std::string::npos) << err_budget;
  EXPECT_NE(err_budget.find("--max-calls "), std::string::npos) << err_budget;
}
#endif

// ---- LOOM_CHECK_CALLS. ----

struct CallChecking {
  bool was = dispatch::call_checking();
  CallChecking() { dispatch::set_call_checking(true); }
  ~CallChecking() { dispatch::set_call_checking(was); }
};

std::string check_error(const std::function<void()>& call) {
  CallChecking on;
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CallCheck, ACallThatBreaksItsDescriptionThrowsNamingTheArgument) {
  Tensor x = test::random_tensor({4, 8}), w = test::random_tensor({8}), b = test::random_tensor({8});
  Tensor out = empty({4, 8}), mean = empty({4}), rstd = empty({4});
  auto ln = [&](const Tensor& xx, const Tensor& ww, Tensor& o, Tensor& m) {
    return [&, xx, ww] { dispatch::call(layer_norm_op, Device(), kF32, xx, ww, b, NormAttrs{}, o, m, rstd); };
  };
  EXPECT_EQ(check_error(ln(x, w, out, mean)), "(no error)");
  Tensor w9 = test::random_tensor({9});
  EXPECT_EQ(check_error(ln(x, w9, out, mean)),
            "LOOM_CHECK_CALLS: op layer_norm, argument 'weight' has shape [9]; the description says [C]: C is 9 but "
            "C = 8 (from 'x' [4, 8])");
  Tensor xt = test::random_tensor({8, 4}).transpose(0, 1);
  EXPECT_NE(check_error(ln(xt, w, out, mean)).find("op layer_norm, argument 'x' [4, 8] strides [1, 4] is not contiguous"),
            std::string::npos);
  Tensor mean64 = empty({4}, kF64);
  EXPECT_NE(check_error(ln(x, w, out, mean64))
                .find("op layer_norm, argument 'mean' has dtype f64; for dispatch dtype f32 the description allows f32"),
            std::string::npos);
  Tensor none;
  EXPECT_EQ(check_error([&] { dispatch::call(layer_norm_op, Device(), kF32, none, w, b, NormAttrs{}, out, mean, rstd); }),
            "LOOM_CHECK_CALLS: op layer_norm, argument 'x' (input) is absent; the description requires it");
}

TEST(CallCheck, GemmMatricesAreCheckedColumnMajorWithKFromTheShapes) {
  // C[m, n] = A[m, k] B[k, n], column-major as stored: [batch, rows, cols], strides [batch stride, 1, ld].
  const int64_t m = 3, n = 5, k = 4;
  Tensor a = empty({k * m}), b = empty({n * k}), c = empty({n * m});
  GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.a = a.data(), p.lda = m, p.b = b.data(), p.ldb = k, p.c = c.data(), p.ldc = m;
  const std::string ok = check_error([&] { dispatch::call(gemm_op, Device(), kF32, p); });
  EXPECT_EQ(ok, "(no error)");
  GemmParams bad = p;
  bad.ldc = m - 1;  // a leading dimension below the rows (validate_gemm_params, in ops::gemm, is not on this path)
  const std::string e = check_error([&] { dispatch::call(gemm_op, Device(), kF32, bad); });
  EXPECT_NE(e.find("op gemm, argument 'c'"), std::string::npos) << e;
  EXPECT_NE(e.find("leading dimension below its rows"), std::string::npos) << e;
}

// A call over one flat dim of a billion elements (an optimizer step over a whole model's buffer) replays on its first
// kReplayFlatElements, and says so; a call of another shape keeps its size.
TEST(OpTrace, AFlatCallPastTheLimitReplaysOnItsFirstElements) {
  TempDir dir;
  const int64_t n = op_trace::kReplayFlatElements * 9 + 3;
  auto t = [&](int buffer) {
    return nlohmann::json{{"dtype", "f32"}, {"shape", {n}}, {"strides", {1}}, {"offset", 0}, {"buffer", buffer}};
  };
  nlohmann::json j = one_call_trace();
  j["calls"][0] = {{"op", "adamw_update"}, {"device", "cpu"}, {"dtype", "f32"}, {"count", 1},
                   {"tensors", {t(0), t(1), t(2), t(3)}},
                   {"attrs", {{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1},
                              {"step", 1200}}}};
  std::ofstream(dir.file("flat.trace")) << j.dump();
  const op_trace::Trace trace = op_trace::read_trace(dir.file("flat.trace"));
  std::string note;
  const conformance::ExplicitCase c = op_trace::replay_case(trace.calls[0], 0, &note);
  for (const auto& tc : c.tensors) EXPECT_EQ(tc.shape, Shape{op_trace::kReplayFlatElements});
  EXPECT_NE(note.find("first " + std::to_string(op_trace::kReplayFlatElements) + " of " + std::to_string(n)),
            std::string::npos)
      << note;
  note.clear();
  const op_trace::Trace small = op_trace::read_trace([&] {
    std::ofstream(dir.file("small.trace")) << one_call_trace().dump();
    return dir.file("small.trace");
  }());
  EXPECT_EQ(op_trace::replay_case(small.calls[0], 0, &note).tensors[0].shape, (Shape{4, 8}));
  EXPECT_EQ(note, "");
}

}  // namespace
}  // namespace loom
