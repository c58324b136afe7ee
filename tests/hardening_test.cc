// Regression tests for what the fuzz targets (tests/fuzz/) and the sanitizer build found in the parsers,
// and the pure pieces of "nothing lost": the checkpoint state parser and the cleanup of stale temporaries.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/common/error.h"
#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/io/atomic_file.h"
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/safetensors.h"
#include "loom/nn/finite_weights.h"
#include "loom/nn/model.h"
#include "loom/ops/views.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"
#include "providers/verify.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string safetensors_bytes(const nlohmann::json& header, const std::string& data = "") {
  std::string h = header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + h + data;
}

// fuzz_safetensors: a tensor of zero elements whose other sizes multiply past int64 passed the byte-count check
// (0 bytes) and overflowed computing its strides (UBSan: signed overflow in contiguous_strides).
TEST(Hardening, SafetensorsZeroElementShapesMustNotOverflowStrides) {
  test::TempDir dir;
  const std::string path = dir.file("zero.safetensors");
  const int64_t big = int64_t(1) << 40;
  test::write_all(path, safetensors_bytes({{"a", {{"dtype", "F32"}, {"shape", {0, big, big}}, {"data_offsets", {0, 0}}}}}));
  test::expect_error_mentioning([&] { io::load_safetensors_file(path); }, {"tensor \"a\"", "overflows"});
  // Zero elements with sizes that fit are fine.
  test::write_all(path, safetensors_bytes({{"a", {{"dtype", "F32"}, {"shape", {0, big}}, {"data_offsets", {0, 0}}}}}));
  io::SafetensorsFile f = io::load_safetensors_file(path);
  EXPECT_EQ(f.tensors.at("a").numel(), 0);
  EXPECT_EQ(f.tensors.at("a").size(1), big);
}

TEST(Hardening, CheckpointStateIsCheckedBeforeUse) {
  const nlohmann::json good = {{"step", 5},
                               {"loader", {{"shard_index", 1}, {"batch_offset", 2}, {"epoch", 3}, {"rng_state", 4}}},
                               {"rng", {{"seed", 6}, {"offset", 7}}}};
  train::CheckpointState st = train::parse_checkpoint_state(good.dump(), "c.safetensors");
  EXPECT_EQ(st.step, 5);
  EXPECT_EQ(st.shard_index, 1);
  EXPECT_EQ(st.batch_offset, 2);
  EXPECT_EQ(st.epoch, 3);
  EXPECT_EQ(st.loader_rng, 4u);
  EXPECT_EQ(st.rng_seed, 6u);
  EXPECT_EQ(st.rng_offset, 7u);
  auto bad = [&](nlohmann::json j, const std::string& what) {
    SCOPED_TRACE(j.dump());
    test::expect_error_mentioning([&] { train::parse_checkpoint_state(j.dump(), "c.safetensors"); },
                                  {"resume: 'c.safetensors' has corrupt state metadata", what});
  };
  auto j = good;
  j["step"] = -1;
  bad(j, "negative step");
  j = good;
  j["loader"]["batch_offset"] = -3;
  bad(j, "negative");
  j = good;
  j["step"] = "five";
  bad(j, "expected a whole number");
  j = good;
  j["rng"].erase("offset");
  bad(j, "offset");
  j = good;
  j["loader"] = 3;
  bad(j, "");
  test::expect_error_mentioning([&] { train::parse_checkpoint_state("{\"step\": 1", "c.safetensors"); },
                                {"corrupt state metadata"});
  // Numbers that are not whole or do not fit: a float was converted without a check (1.7e59 is undefined
  // behaviour; fuzz_checkpoint found it), 3.5 became 3.
  j = good;
  j["loader"]["epoch"] = 1.6666e59;
  bad(j, "whole number");
  j = good;
  j["step"] = 3.5;
  bad(j, "whole number");
  j = good;
  j["rng"]["seed"] = -2;
  bad(j, "non-negative whole number");
  j = good;
  j["loader"]["shard_index"] = uint64_t(1) << 63;
  bad(j, "within 64 bits");
}

// Temporaries of killed writes: removed when older than `before` and their writer is gone; a running writer's, a
// fresh one and other files stay; a planted link is removed itself, never its target.
TEST(Hardening, StaleTemporariesAreRemovedAndNothingElse) {
  test::TempDir dir;
  const auto old_time = fs::file_time_type::clock::now() - std::chrono::hours(2);
  auto make = [&](const std::string& name, bool old) {
    const std::string p = dir.file(name);
    test::write_all(p, "partial");
    if (old) fs::last_write_time(p, old_time);
    return p;
  };
  const std::string here = "@" + io::temp_owner_tag(0, io::host_id()).substr(2);  // "@<this host>"
  const std::string dead = make(".loom.tmp.step_000001.safetensors.0" + here + ".ab12", true);
  const std::string running = make(".loom.tmp.step_000002.safetensors." + std::to_string(::getppid()) + here + ".cd", true);
  const std::string fresh = make(".loom.tmp.step_000003.safetensors.0" + here + ".ef", false);
  const std::string other = make("step_000001.safetensors.tmp.1.2", true);
  // Another host's writer (a directory several machines share) may still run: its temporary stays until nothing
  // wrote it for a day, whatever pid it names; so does one of an older Loom's names, whose host is unknown.
  const std::string elsewhere = make(".loom.tmp.step_000004.safetensors.0@" +
                                         io::temp_owner_tag(0, io::host_id() ^ 1u).substr(2) + ".aa", true);
  const std::string older_form = make(".loom.tmp.step_000005.safetensors.0.bb", true);
  const std::string elsewhere_long_ago = make(".loom.tmp.step_000006.safetensors.0@" +
                                                  io::temp_owner_tag(0, io::host_id() ^ 1u).substr(2) + ".cc", true);
  fs::last_write_time(elsewhere_long_ago, fs::file_time_type::clock::now() - std::chrono::hours(25));
  const std::string target = make("precious.txt", true);
  const std::string link = dir.file(".loom.tmp.latest.0.99");
  fs::create_symlink(target, link);
  const auto before = fs::file_time_type::clock::now() - std::chrono::hours(1);
  std::vector<std::string> removed = io::remove_stale_temporaries(dir.path().string(), before);
  std::sort(removed.begin(), removed.end());
  std::vector<std::string> expected{link, dead, elsewhere_long_ago};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::is_symlink(link));
  EXPECT_TRUE(fs::exists(running) && fs::exists(fresh) && fs::exists(other));
  EXPECT_TRUE(fs::exists(elsewhere) && fs::exists(older_form));
  EXPECT_EQ(test::read_all(target), "partial");
  // A writer's temporary carries the prefix, beside its target.
  io::AtomicFileWriter w(dir.file("x.bin"));
  EXPECT_EQ(fs::path(w.temp_path()).parent_path(), dir.path());
  EXPECT_EQ(fs::path(w.temp_path()).filename().string().rfind(std::string(io::kTempPrefix) + "x.bin.", 0), 0u);
  EXPECT_NE(w.temp_path().find("." + std::to_string(::getpid()) + here + "."), std::string::npos) << w.temp_path();
  EXPECT_TRUE(io::remove_stale_temporaries((dir.path() / "missing").string(), before).empty());
}


// A file's JSON nested past the limit is refused before nlohmann recurses (200,000 levels overflowed the stack in
// its parser and in dump()), one line naming the file; nlohmann's own text never reaches a message.
TEST(Hardening, JsonNestedPastTheLimitIsOneLineNamingTheFile) {
  test::TempDir dir;
  const std::string path = dir.file("deep.json");
  test::write_all(path, "{\"a\": " + std::string(200000, '[') + std::string(200000, ']') + "}");
  test::expect_error_mentioning([&] { io::read_json_file(path); }, {path, "nested more than 256 levels"});
  // Brackets inside strings do not count; the limit itself parses.
  const std::string at_limit = std::string(io::kJsonMaxDepth, '[') + "\"[[[[{{{{\"" + std::string(io::kJsonMaxDepth, ']');
  EXPECT_NO_THROW(io::parse_json(at_limit, "at the limit"));
  test::expect_error_mentioning([&] { io::parse_json("[" + at_limit + "]", "one past"); }, {"one past", "nested"});
  try {
    io::parse_json("{\"lr\": 3e-4,}", "--config");
    ADD_FAILURE() << "invalid JSON accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--config: invalid JSON"), std::string::npos) << m;
    EXPECT_EQ(m.find("[json.exception"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  // A directory or a missing file is named as such.
  test::expect_error_mentioning([&] { io::read_json_file(dir.path().string()); }, {"is a directory"});
  test::expect_error_mentioning([&] { io::read_json_file(dir.file("missing.json")); }, {"missing.json", "does not exist"});
}

// Values in messages are cut to their bound, whatever their size, and invalid UTF-8 does not throw.
TEST(Hardening, JsonExcerptsAreBounded) {
  nlohmann::json big = nlohmann::json::array();
  for (int i = 0; i < 100000; ++i) big.push_back(i);
  const std::string e = io::json_excerpt(big, 40);
  EXPECT_EQ(e.size(), 43u) << e;
  EXPECT_EQ(e.substr(0, 8), "[0,1,2,3");
  EXPECT_EQ(e.substr(40), "...");
  EXPECT_EQ(io::json_excerpt(nlohmann::json(std::string(1 << 20, 'x')), 10).size(), 13u);
  EXPECT_EQ(io::json_excerpt(nlohmann::json(std::string("\xff\xfe", 2))).size(), 8u);  // "\ufffd\ufffd" as UTF-8, quoted
  EXPECT_EQ(io::json_excerpt(nlohmann::json{{"a", 1}}), "{\"a\":1}");
}

// Hugging Face configs: every size is checked before it divides or multiplies anything.
TEST(Hardening, HfConfigSizesAreCheckedBeforeUse) {
  auto llama = [](nlohmann::json extra) {
    nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 128}, {"hidden_size", 16}, {"intermediate_size", 32},
                        {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                        {"max_position_embeddings", 64}};
    if (extra.is_object()) j.update(extra);
    return j.dump();
  };
  EXPECT_NO_THROW(nn::ModelConfig::from_json(llama({})));
  test::expect_error_mentioning([&] { nn::ModelConfig::from_json(llama({{"num_attention_heads", 0}, {"head_dim", 4}})); },
                                {"num_attention_heads", "must be positive"});
  test::expect_error_mentioning([&] { nn::ModelConfig::from_json(llama({{"head_dim", -4}})); }, {"head_dim", "-4"});
  test::expect_error_mentioning([&] { nn::ModelConfig::from_json(llama({{"max_position_embeddings", int64_t(1) << 40}})); },
                                {"max_seq_len", "1099511627776"});
  test::expect_error_mentioning([&] { nn::ModelConfig::from_json(llama({{"vocab_size", uint64_t(1) << 63}})); },
                                {"vocab_size", "integer within 64 bits"});
  test::expect_error_mentioning(
      [&] { nn::ModelConfig::from_json(R"({"model_type": "gpt2", "n_embd": 9223372036854775807})"); }, {"n_embd"});
  // Sizes each within the limit whose model cannot fit this machine: refused before allocating.
  const nn::ModelConfig huge = nn::ModelConfig::from_json(
      llama({{"vocab_size", 2000000000}, {"hidden_size", 65536}, {"num_attention_heads", 512}}));
  test::expect_error_mentioning([&] { nn::make_model(huge); }, {"more than this machine's"});
  // A config.json that is a directory says so.
  test::TempDir dir;
  std::filesystem::create_directories(dir.path() / "config.json");
  test::expect_error_mentioning([&] { nn::ModelConfig::from_name(dir.path().string()); },
                                {"config.json", "not a regular file"});
}

// GPT-2 weights with fewer vocabulary rows than the config names: an error, not rows of zeros.
TEST(Hardening, Gpt2EmbeddingsMustCoverTheVocabulary) {
  nn::ModelConfig cfg = nn::ModelConfig::from_json(
      R"({"family": "gpt2", "vocab_size": 100, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "n_embd": 8})");
  auto model = nn::make_model(cfg);
  std::vector<std::pair<std::string, Tensor>> weights = model->hf_state_dict();
  for (auto& [name, t] : weights)
    if (name == "wte.weight") t = ops::contiguous(ops::narrow(t, 0, 0, 90));
  auto fresh = nn::make_model(cfg);
  test::expect_error_mentioning([&] { fresh->load_hf_state_dict(weights); }, {"wte.weight", "90", "vocab_size 100"});
}

// Weights loaded for inference are checked: a NaN is one line naming the tensor.
TEST(Hardening, NonFiniteWeightsAreNamed) {
  nn::ModelConfig cfg = nn::ModelConfig::from_json(
      R"({"family": "gpt2", "vocab_size": 50, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "n_embd": 8})");
  auto model = nn::make_model(cfg);
  model->init_weights(1);
  EXPECT_NO_THROW(nn::check_finite_parameters(*model, "ok.safetensors"));
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    for (auto& [name, p] : model->named_parameters())
      if (name == "h.0.mlp.c_fc.weight") static_cast<float*>(p.data())[3] = bad;
    test::expect_error_mentioning([&] { nn::check_finite_parameters(*model, "bad.safetensors"); },
                                  {"bad.safetensors", "h.0.mlp.c_fc.weight", "element 3"});
    for (auto& [name, p] : model->named_parameters())
      if (name == "h.0.mlp.c_fc.weight") static_cast<float*>(p.data())[3] = 0.5f;
  }
}

// No output replaces an input: the same path, a hard link, a symlink, or a directory a writer clears.
TEST(Hardening, OutputsNeverReplaceInputs) {
  test::TempDir dir;
  const std::string in = dir.file("model.safetensors");
  io::save_safetensors(in, {{"w", test::random_tensor({4})}});
  const std::string before = test::read_all(in);
  io::protect_inputs();
  struct Off {
    ~Off() { io::protect_inputs(false); }
  } off;
  io::load_safetensors_file(in);
  std::filesystem::create_hard_link(in, dir.file("hard.safetensors"));
  std::filesystem::create_symlink(in, dir.file("soft.safetensors"));
  for (const std::string& out : {in, dir.file("hard.safetensors"), dir.file("soft.safetensors"),
                                 dir.path().string() + "/./model.safetensors"})
    test::expect_error_mentioning([&] { io::save_safetensors(out, {{"w", test::random_tensor({4})}}); },
                                  {"refusing to write", "which this run read"});
  test::expect_error_mentioning([&] { io::write_file_atomic(in, "x"); }, {in});
  test::expect_error_mentioning([&] { io::check_output_dir(dir.path().string()); }, {"refusing to write into"});
  EXPECT_EQ(test::read_all(in), before);
  // Another file in the same directory is fine.
  EXPECT_NO_THROW(io::save_safetensors(dir.file("other.safetensors"), {{"w", test::random_tensor({4})}}));
  // An input this run removed no longer holds its inode, which the next file created may get (an old checkpoint
  // pruned, then the new "latest" written): the file now under that inode is not the input. Here the input's last
  // name goes, so the inode lives on only as the hard link, which is then no input of this run.
  std::filesystem::remove(in);
  std::filesystem::remove(dir.file("soft.safetensors"));
  EXPECT_NO_THROW(io::save_safetensors(dir.file("hard.safetensors"), {{"w", test::random_tensor({4})}}));
}

// Policy files: an empty provider and a deep file are errors naming the file; an unknown device type is an error
// at the first dispatch, as an unknown provider is.
TEST(Hardening, PolicyFileTyposAreErrors) {
  test::TempDir dir;
  const std::string path = dir.file("policy.json");
  for (const std::string& text : {std::string(R"({"shadow": ""})"), std::string(R"({"deny": ""})"),
                                  std::string(R"({"routes": {"gemm": [""]}})")}) {
    test::write_all(path, text);
    test::expect_error_mentioning([&] { ProviderPolicy::load_file(path); }, {path, "empty provider"});
  }
  test::write_all(path, "{\"routes\": " + std::string(100000, '[') + "}");
  test::expect_error_mentioning([&] { ProviderPolicy::load_file(path); }, {path, "nested"});
  ProviderPolicy p;
  p.device_routes["cdua"]["gemm"] = {"native"};
  const ProviderPolicy old = dispatch::policy();
  dispatch::set_policy(p);
  test::expect_error_mentioning([&] { dispatch::explain("gemm", kCPU, kF32); }, {"device type 'cdua'", "unknown"});
  dispatch::set_policy(old);
  EXPECT_NO_THROW(dispatch::explain("gemm", kCPU, kF32));
}

// A file given as the verify cache that is not one is left as it is, and the caller is told.
TEST(Hardening, AVerifyCacheThatIsNotOneIsNeverOverwritten) {
  test::TempDir dir;
  const std::string path = dir.file("notes.txt");
  test::write_all(path, "my notes, not JSON");
  dispatch::set_verify_cache(path);
  dispatch::Verification v;
  v.provider = "native", v.op = "add", v.dtype = "f32", v.device = "cpu", v.status = "verified";
  const std::string why = dispatch::record_verifications_to_cache({v});
  dispatch::set_verify_cache("");
  dispatch::reset_verifications();
  EXPECT_NE(why.find("left as it is"), std::string::npos) << why;
  EXPECT_EQ(test::read_all(path), "my notes, not JSON");
}

// A sharded checkpoint whose metadata names rank files that are not there, or a layout past 64 bits, is refused at
// open, naming the file.
TEST(Hardening, ShardedMetaMustMatchItsFiles) {
  nlohmann::json meta = {
      {"format", train::kShardedCheckpointFormat}, {"step", 1},
      {"state", {{"step", 1}, {"loader", {{"shard_index", 0}, {"batch_offset", 0}, {"epoch", 0}, {"rng_state", 1}}},
                 {"rng", {{"seed", 1}, {"offset", 0}}}}},
      {"model", "d2"}, {"config", {{"family", "gpt2"}}},
      {"layout", {{"world", 2}, {"dp", 2}, {"tp", 1}, {"zero", 0}, {"pp", 1}}},
      {"optimizer", {{"step", 1}, {"lr", 0.1}}}, {"files", {"rank0.safetensors", "rank1.safetensors"}},
      {"parameters", nlohmann::json::array()}};
  test::TempDir dir;
  test::write_all(dir.file("meta.json"), meta.dump());
  test::write_all(dir.file("rank0.safetensors"), "");
  test::expect_error_mentioning([&] { train::ShardedCheckpointReader r(dir.path().string()); },
                                {"rank1.safetensors", "not there"});
  meta["layout"] = {{"world", 2}, {"dp", int64_t(1) << 62}, {"tp", 8}, {"zero", 0}, {"pp", 1}};
  test::expect_error_mentioning([&] { train::CheckpointMeta::parse(meta.dump(), "m.json"); }, {"m.json", "layout"});
}

// The profiler's variables are read by the apps (apps/cli), never inside the library: a program built on libloom
// decides itself (dispatch::report_op_profile_at_exit), and nothing deep in core reads the environment for it.
TEST(Hardening, TheLibraryReadsNoProfilingVariable) {
  size_t files = 0;
  for (const auto& e : fs::recursive_directory_iterator(std::string(LOOM_SOURCE_DIR) + "/src")) {
    if (!e.is_regular_file()) continue;
    ++files;
    const std::string text = test::read_all(e.path().string());
    EXPECT_EQ(text.find("getenv(\"LOOM_PROFILE_OPS"), std::string::npos) << e.path();
  }
  EXPECT_GT(files, 50u);
  const std::string cli = test::read_all(std::string(LOOM_SOURCE_DIR) + "/apps/cli/cli.cc");
  EXPECT_NE(cli.find("getenv(\"LOOM_PROFILE_OPS\")"), std::string::npos);
}

}  // namespace
}  // namespace loom
