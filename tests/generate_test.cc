// Text generation: the sampler (greedy, top-k, top-p, seeds, repetition penalty), nn::generate (cache, streaming
// callback, stop tokens and strings, several samples), and the
// loom-generate and loom-export apps end to end (same tokens as nn::generate; every bad input one line, non-zero).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "loom/autograd/grad_mode.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::vector<double> random_logits(size_t n, uint64_t seed) {
  std::mt19937_64 eng(seed);
  std::normal_distribution<double> d(0.0, 3.0);
  std::vector<double> l(n);
  for (auto& x : l) x = d(eng);
  return l;
}

TEST(Sampler, GreedyIsTheFirstArgmax) {
  const uint64_t seed = test::fresh_seed();
  std::vector<double> l = random_logits(1001, seed);
  nn::GenerateOptions g;
  g.temperature = 0;
  std::mt19937_64 rng(seed);
  const size_t best = size_t(std::max_element(l.begin(), l.end()) - l.begin());
  EXPECT_EQ(nn::sample_token(l, g, rng), int32_t(best)) << "seed " << seed;
  l[7] = l[900] = l[best] + 1;  // a tie: the lower id, as torch.argmax
  EXPECT_EQ(nn::sample_token(l, g, rng), 7);
}

TEST(Sampler, TopKChoosesOnlyTheKMostLikelyAndEachOfThem) {
  const uint64_t seed = test::fresh_seed();
  std::vector<double> l = random_logits(500, seed);
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
  const std::set<int32_t> top(order.begin(), order.begin() + 5);
  nn::GenerateOptions g;
  g.top_k = 5;
  g.temperature = 20.0;  // nearly flat over the five: each must come up
  std::mt19937_64 rng(seed);
  std::set<int32_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = nn::sample_token(l, g, rng);
    ASSERT_TRUE(top.count(t)) << "token " << t << " is not among the top 5 (seed " << seed << ")";
    seen.insert(t);
  }
  EXPECT_EQ(seen, top);
}

TEST(Sampler, TopPKeepsTheNucleusWithItsOwnProportions) {
  // Probabilities 0.6, 0.25, 0.1, 0.05 (in a shuffled order of ids).
  const std::vector<double> p = {0.1, 0.6, 0.05, 0.25};
  std::vector<double> l;
  for (double x : p) l.push_back(std::log(x));
  nn::GenerateOptions g;
  std::mt19937_64 rng(test::fresh_seed());
  auto counts = [&](double top_p, int n) {
    g.top_p = top_p;
    std::map<int32_t, int> c;
    for (int i = 0; i < n; ++i) ++c[nn::sample_token(l, g, rng)];
    return c;
  };
  auto only = [](const std::map<int32_t, int>& c, std::set<int32_t> ids) {
    std::set<int32_t> got;
    for (auto& [t, n] : c) got.insert(t);
    return got == ids;
  };
  EXPECT_TRUE(only(counts(0.5, 500), {1}));
  EXPECT_TRUE(only(counts(0.8, 2000), {1, 3}));
  const int n = 40000;
  auto c = counts(0.9, n);
  ASSERT_TRUE(only(c, {0, 1, 3}));
  // Renormalized over the nucleus: 0.6 / 0.95, 0.25 / 0.95, 0.1 / 0.95 (5 sigma of a binomial at n = 40000 < 0.013).
  EXPECT_NEAR(double(c[1]) / n, 0.6 / 0.95, 0.013);
  EXPECT_NEAR(double(c[3]) / n, 0.25 / 0.95, 0.013);
  EXPECT_NEAR(double(c[0]) / n, 0.1 / 0.95, 0.013);
  // top_k cuts first, top_p then works on what is left (Hugging Face's order): top-2 renormalized is 0.706, 0.294.
  g.top_k = 2;
  EXPECT_TRUE(only(counts(0.7, 500), {1}));
  EXPECT_TRUE(only(counts(0.75, 2000), {1, 3}));
  g.top_p = 0;
  EXPECT_THROW(nn::sample_token(l, g, rng), Error);
}

nn::ModelConfig tiny_llama() {
  nn::ModelConfig c = nn::ModelConfig::from_name("llama3-tiny");
  c.vocab_size = 1001;
  c.padded_vocab_size = 1024;
  c.head_dim = 24;
  c.max_seq_len = 48;
  return c;
}

TEST(Generate, SeededReproducibleCachedAndStreamed) {
  auto model = nn::make_model(tiny_llama());
  model->init_weights(test::fresh_seed());
  const std::vector<int32_t> prompt = {5, 900, 17, 1000};
  nn::GenerateOptions g;
  g.max_new_tokens = 20;
  g.top_k = 50;
  g.top_p = 0.95;
  g.temperature = 1.5;
  g.seed = test::fresh_seed();
  auto a = nn::generate(*model, prompt, g);
  auto b = nn::generate(*model, prompt, g);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 20u);
  g.seed += 1;
  EXPECT_NE(nn::generate(*model, prompt, g), a) << "another seed gave the same 20 tokens at temperature 1.5";
  // Greedy with and without the cache, past the context (48) so the window slides.
  nn::GenerateOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 60;
  auto cached = nn::generate(*model, prompt, greedy);
  greedy.use_kv_cache = false;
  EXPECT_EQ(nn::generate(*model, prompt, greedy), cached);
  // The callback sees each token as it is made and can stop.
  std::vector<int32_t> streamed;
  greedy.use_kv_cache = true;
  greedy.on_token = [&](int32_t t) {
    streamed.push_back(t);
    return streamed.size() < 7;
  };
  auto stopped = nn::generate(*model, prompt, greedy);
  EXPECT_EQ(stopped, streamed);
  EXPECT_EQ(stopped, std::vector<int32_t>(cached.begin(), cached.begin() + 7));
  EXPECT_THROW(nn::generate(*model, {1001}, greedy), Error);
}

TEST(Sampler, RepetitionPenaltyAsTransformers) {
  // Seen tokens 0, 1 (twice), 4 and 9 (outside the logits: ignored). 0: 2.0 / 2; 1: -1.0 * 2 once; 4: 0 stays 0.
  std::vector<double> l = {2.0, -1.0, 0.5, -3.0, 0.0};
  nn::apply_repetition_penalty(l, {0, 1, 1, 4, 9}, 2.0);
  EXPECT_EQ(l, (std::vector<double>{1.0, -2.0, 0.5, -3.0, 0.0}));
  nn::apply_repetition_penalty(l, {0, 3}, 0.5);  // below 1 favours repeats
  EXPECT_EQ(l, (std::vector<double>{2.0, -2.0, 0.5, -1.5, 0.0}));
  EXPECT_THROW(nn::apply_repetition_penalty(l, {0}, 0.0), Error);
  EXPECT_THROW(nn::apply_repetition_penalty(l, {0}, std::nan("")), Error);
}

// Greedy decoding with a penalty picks, at each step, the argmax of the last logits of a full forward (no cache)
// with the penalty applied by hand over the prompt and the tokens so far.
TEST(Generate, RepetitionPenaltyMatchesAHandLoop) {
  auto model = nn::make_model(tiny_llama(), test::fresh_seed());
  const std::vector<int32_t> prompt = {5, 900, 17, 5, 1000};
  nn::GenerateOptions g;
  g.temperature = 0;
  g.max_new_tokens = 10;
  g.repetition_penalty = 1.7;
  const auto got = nn::generate(*model, prompt, g);
  std::vector<int32_t> seq = prompt;
  autograd::NoGradGuard ng;
  model->eval();
  for (int step = 0; step < 10; ++step) {
    Tensor logits = model->forward(from_vector(seq, {1, int64_t(seq.size())}));
    std::vector<double> last = to_vector<double>(ops::select(ops::select(logits, 0, 0), 0, int64_t(seq.size()) - 1));
    last.resize(1001);
    std::set<int32_t> seen(seq.begin(), seq.end());
    for (int32_t t : seen) last[size_t(t)] = last[size_t(t)] > 0 ? last[size_t(t)] / 1.7 : last[size_t(t)] * 1.7;
    seq.push_back(int32_t(std::max_element(last.begin(), last.end()) - last.begin()));
  }
  EXPECT_EQ(got, std::vector<int32_t>(seq.begin() + int64_t(prompt.size()), seq.end()));
  g.repetition_penalty = -1;
  EXPECT_THROW(nn::generate(*model, prompt, g), Error);
}

// Generation ends at the first stop token (returned), whichever of several it is; a stop token never reached
// changes nothing.
TEST(Generate, StopsAtAStopToken) {
  auto model = nn::make_model(tiny_llama(), test::fresh_seed());
  const std::vector<int32_t> prompt = {3, 14, 15};
  nn::GenerateOptions g;
  g.temperature = 0;
  g.max_new_tokens = 30;
  const auto full = nn::generate(*model, prompt, g);
  ASSERT_EQ(full.size(), 30u);
  const int32_t eot = full[4];
  const size_t first = size_t(std::find(full.begin(), full.end(), eot) - full.begin());
  g.stop_tokens = {1000, eot};
  if (std::find(full.begin(), full.end(), 1000) < full.begin() + int64_t(first)) GTEST_SKIP() << "1000 came first";
  EXPECT_EQ(nn::generate(*model, prompt, g), std::vector<int32_t>(full.begin(), full.begin() + int64_t(first) + 1));
  std::set<int32_t> unseen;
  for (int32_t t = 0; t < 1001 && unseen.size() < 3; ++t)
    if (std::find(full.begin(), full.end(), t) == full.end()) unseen.insert(t);
  g.stop_tokens.assign(unseen.begin(), unseen.end());
  EXPECT_EQ(nn::generate(*model, prompt, g), full);
  // Sampled: the stop token is the last one, and only there.
  g.temperature = 1.0;
  g.seed = test::fresh_seed();
  g.stop_tokens = {};
  const auto sampled = nn::generate(*model, prompt, g);
  g.stop_tokens = {sampled[2]};
  const auto cut = nn::generate(*model, prompt, g);
  ASSERT_FALSE(cut.empty());
  EXPECT_EQ(cut.back(), sampled[2]);
  EXPECT_EQ(std::count(cut.begin(), cut.end(), sampled[2]), 1);
  EXPECT_EQ(cut, std::vector<int32_t>(sampled.begin(), sampled.begin() + int64_t(cut.size())));
}

// Generation ends once the decoded new text contains a stop string, even one spanning tokens; the prompt's text does
// not count.
TEST(Generate, StopsAtAStopString) {
  auto model = nn::make_model(tiny_llama(), test::fresh_seed());
  const std::vector<int32_t> prompt = {7, 8, 9};
  auto decode = [](const std::vector<int32_t>& ids) {
    std::string s;
    for (int32_t t : ids) s += "<" + std::to_string(t) + ">";
    return s;
  };
  nn::GenerateOptions g;
  g.temperature = 0;
  g.max_new_tokens = 25;
  const auto full = nn::generate(*model, prompt, g);
  ASSERT_EQ(full.size(), 25u);
  // The end of token 5's text and the start of token 6's: completed by token 6 at the earliest.
  const std::string t5 = std::to_string(full[5]), t6 = std::to_string(full[6]);
  const std::string stop = t5.substr(t5.size() - 1) + "><" + t6.substr(0, 1);
  size_t want = 0;
  while (decode(std::vector<int32_t>(full.begin(), full.begin() + int64_t(want))).find(stop) == std::string::npos)
    ++want;
  ASSERT_LE(want, 7u);
  g.stop_strings = {"never", stop, "<7>"};  // "<7>" is the prompt's text
  g.decode = decode;
  const auto cut = nn::generate(*model, prompt, g);
  if (std::find(full.begin(), full.begin() + int64_t(want), 7) != full.begin() + int64_t(want))
    GTEST_SKIP() << "the model made token 7";
  EXPECT_EQ(cut, std::vector<int32_t>(full.begin(), full.begin() + int64_t(want)));
  g.decode = nullptr;
  EXPECT_THROW(nn::generate(*model, prompt, g), Error);
  g.decode = decode;
  g.stop_strings = {""};
  EXPECT_THROW(nn::generate(*model, prompt, g), Error);
}

// N samples: sample i is generate() with seed + i, they differ from each other, and the same seed repeats them.
TEST(Generate, SeveralSamplesDifferAndRepeat) {
  auto model = nn::make_model(tiny_llama(), test::fresh_seed());
  const std::vector<int32_t> prompt = {1, 2, 3};
  nn::GenerateOptions g;
  g.max_new_tokens = 16;
  g.temperature = 1.2;
  g.seed = test::fresh_seed();
  std::vector<int64_t> started;
  const auto samples = nn::generate_samples(*model, prompt, g, 3, [&](int64_t i) { started.push_back(i); });
  EXPECT_EQ(started, (std::vector<int64_t>{0, 1, 2}));
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_NE(samples[0], samples[1]);
  EXPECT_NE(samples[1], samples[2]);
  EXPECT_NE(samples[0], samples[2]);
  EXPECT_EQ(nn::generate_samples(*model, prompt, g, 3), samples);
  for (int i = 0; i < 3; ++i) {
    nn::GenerateOptions one = g;
    one.seed = g.seed + uint64_t(i);
    EXPECT_EQ(nn::generate(*model, prompt, one), samples[size_t(i)]) << i;
  }
  EXPECT_THROW(nn::generate_samples(*model, prompt, g, 0), Error);
}

#if defined(LOOM_GENERATE_EXE) && defined(LOOM_EXPORT_EXE)
struct AppRun {
  int status = 0;
  std::string out;  // stdout
  std::string all;  // stdout and stderr
};
AppRun run(const std::string& exe, const std::string& args, const std::string& stdin_text = "") {
  TempDir tmp;
  const std::string err = tmp.file("stderr"), in = tmp.file("stdin");
  test::write_all(in, stdin_text);
  AppRun r;
  FILE* p = popen((exe + " " + args + " <" + in + " 2>" + err).c_str(), "r");
  if (!p) return {-1, "popen failed", "popen failed"};
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.out.append(buf.data(), n);
  r.status = pclose(p);
  r.all = r.out + test::read_all(err);
  return r;
}

std::vector<int32_t> ids_of(const std::string& text) {
  std::istringstream in(text);
  std::vector<int32_t> ids;
  int32_t t;
  while (in >> t) ids.push_back(t);
  return ids;
}

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t t : ids) s += (s.empty() ? "" : ",") + std::to_string(t);
  return s;
}

// loom-generate gives the tokens nn::generate gives, from a Hugging Face directory (LLaMA, odd vocabulary, head_dim
// apart) and from an llm.c file (GPT-2), greedy and sampled.
TEST(LoomGenerate, SameTokensAsNnGenerate) {
  TempDir dir;
  auto llama = nn::make_model(tiny_llama());
  llama->init_weights(test::fresh_seed());
  io::save_hf_model_dir(dir.file("hf"), *llama, {});
  auto gpt2_cfg = nn::ModelConfig::from_name("d2");
  gpt2_cfg.max_seq_len = 64;
  auto gpt2 = nn::make_model(gpt2_cfg);
  gpt2->init_weights(test::fresh_seed());
  io::save_llmc_model(dir.file("gpt2.bin"), *gpt2);
  struct Case {
    std::string path;
    std::shared_ptr<nn::LanguageModel> model;
  };
  for (const Case& c : {Case{dir.file("hf"), io::load_hf_model(dir.file("hf"))}, Case{dir.file("gpt2.bin"), gpt2}}) {
    SCOPED_TRACE(c.path);
    const std::vector<int32_t> prompt = {3, 1000, 42, 7, 512};
    nn::GenerateOptions g;
    g.temperature = 0;
    g.max_new_tokens = 12;
    AppRun r = run(LOOM_GENERATE_EXE, "-m " + c.path + " --prompt-tokens " + join(prompt) + " -n 12 --greedy");
    ASSERT_EQ(r.status, 0) << r.all;
    EXPECT_EQ(ids_of(r.out), nn::generate(*c.model, prompt, g)) << r.all;
    EXPECT_NE(r.all.find("tokens/s"), std::string::npos) << r.all;
    g.temperature = 0.9;
    g.top_k = 40;
    g.top_p = 0.9;
    g.seed = test::fresh_seed() % 1000000;
    r = run(LOOM_GENERATE_EXE, "-m " + c.path + " --prompt-tokens " + join(prompt) +
                                   " -n 12 --temperature 0.9 --top-k 40 --top-p 0.9 --seed " + std::to_string(g.seed));
    ASSERT_EQ(r.status, 0) << r.all;
    EXPECT_EQ(ids_of(r.out), nn::generate(*c.model, prompt, g)) << r.all;
  }
}

// Text in and out with a GPT-2 vocabulary written for the test: the prompt from --prompt, --prompt-file and stdin
// encodes the same, and the text printed is the prompt then the decoded new tokens.
TEST(LoomGenerate, TextFromFlagFileAndStdin) {
  std::string vocab;
  try {
    vocab = data::GPT2Tokenizer::find_vocab_dir("");
  } catch (const Error&) {
    GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh";
  }
  TempDir dir;
  auto cfg = nn::ModelConfig::from_name("gpt2-tiny");
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  io::HfExportOptions opts;
  opts.gpt2_vocab_dir = vocab;
  io::save_hf_model_dir(dir.file("hf"), *model, opts);
  test::write_all(dir.file("prompt.txt"), "ROMEO: art thou");
  data::GPT2Tokenizer tok(vocab);
  const auto prompt = tok.encode("ROMEO: art thou");
  nn::GenerateOptions g;
  g.temperature = 0;
  g.max_new_tokens = 8;
  const std::string want = "ROMEO: art thou" + tok.decode(nn::generate(*model, prompt, g)) + "\n";
  for (const auto& [args, in] : std::vector<std::pair<std::string, std::string>>{
           {"--prompt 'ROMEO: art thou'", ""}, {"--prompt-file " + dir.file("prompt.txt"), ""}, {"", "ROMEO: art thou"}}) {
    AppRun r = run(LOOM_GENERATE_EXE, "-m " + dir.file("hf") + " -n 8 --greedy " + args, in);
    ASSERT_EQ(r.status, 0) << args << "\n" << r.all;
    EXPECT_EQ(r.out, want) << args;
  }
}

// One line on stderr, nothing on stdout, a non-zero status, and the line names what was wrong.
void expect_one_line_error(const std::string& exe, const std::string& args, const std::string& names,
                           const std::string& stdin_text = "") {
  AppRun r = run(exe, args, stdin_text);
  SCOPED_TRACE(args);
  EXPECT_NE(r.status, 0) << r.all;
  EXPECT_NE(r.all.find(names), std::string::npos) << r.all;
  const std::string err = r.all.substr(r.out.size());
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_NE(err.find("error"), std::string::npos) << err;
}

// --num-samples and --repetition-penalty give nn::generate_samples' tokens, one line of ids per sample under its
// header; the new flags' bad values are one error line.
TEST(LoomGenerate, SamplesAndPenaltyAsTheLibrary) {
  TempDir dir;
  auto model = nn::make_model(tiny_llama(), test::fresh_seed());
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  const std::vector<int32_t> prompt = {3, 1000, 42};
  nn::GenerateOptions g;
  g.max_new_tokens = 6;
  g.temperature = 0.8;
  g.repetition_penalty = 1.3;
  g.seed = test::fresh_seed() % 1000000;
  AppRun r = run(LOOM_GENERATE_EXE, "-m " + dir.file("hf") + " --prompt-tokens " + join(prompt) +
                                        " -n 6 --temperature 0.8 --repetition-penalty 1.3 --num-samples 2 --seed " +
                                        std::to_string(g.seed));
  ASSERT_EQ(r.status, 0) << r.all;
  const auto want = nn::generate_samples(*model, prompt, g, 2);
  const size_t second = r.out.find("--- sample 2 of 2 ---");
  ASSERT_NE(second, std::string::npos) << r.out;
  const std::string first_ids = r.out.substr(r.out.find('\n') + 1, second - r.out.find('\n') - 1);
  EXPECT_EQ(ids_of(first_ids), want[0]) << r.out;
  EXPECT_EQ(ids_of(r.out.substr(r.out.find('\n', second) + 1)), want[1]) << r.out;
  const std::string m = "-m " + dir.file("hf") + " ";
  expect_one_line_error(LOOM_GENERATE_EXE, m + "--prompt-tokens 1 --repetition-penalty 0", "--repetition-penalty");
  expect_one_line_error(LOOM_GENERATE_EXE, m + "--prompt-tokens 1 --num-samples 0", "--num-samples");
  expect_one_line_error(LOOM_GENERATE_EXE, m + "--prompt-tokens 1 --stop x", "--stop");
}

TEST(LoomGenerate, BadInputsAreOneLine) {
  TempDir dir;
  auto model = nn::make_model(tiny_llama());
  model->init_weights(1);
  io::save_hf_model_dir(dir.file("hf"), *model, {});
  const std::string m = "-m " + dir.file("hf") + " ";
  const std::string exe = LOOM_GENERATE_EXE;
  expect_one_line_error(exe, m + "--prompt-tokens 1,2 --top-p 0", "--top-p");
  expect_one_line_error(exe, m + "--prompt-tokens 1,2 --top-p 1.5", "--top-p");
  expect_one_line_error(exe, m + "--prompt-tokens 1,2 --temperature -1", "--temperature");
  expect_one_line_error(exe, m + "--prompt-tokens 1,2 --top-k -3", "--top-k");
  expect_one_line_error(exe, m + "--prompt-tokens 1,x", "'x'");
  expect_one_line_error(exe, m + "--prompt-tokens 1,1001", "1001");
  expect_one_line_error(exe, m + "--prompt-file " + dir.file("nope.txt"), "nope.txt");
  expect_one_line_error(exe, m + "--prompt hello", "tokenizer.model");  // LLaMA without its tokenizer
  expect_one_line_error(exe, m + "--prompt-tokens 1 --device cuda:99", "cuda");
  expect_one_line_error(exe, "-m " + dir.file("missing") + " --prompt-tokens 1", "missing");
  fs::create_directories(dir.file("empty"));
  expect_one_line_error(exe, "-m " + dir.file("empty") + " --prompt-tokens 1", "config.json");
  test::write_all(dir.file("junk.safetensors"), "junk");
  expect_one_line_error(exe, "-m " + dir.file("junk.safetensors") + " --prompt-tokens 1", "junk.safetensors");
}

TEST(LoomExport, HfDirectoryAndItsErrors) {
  TempDir dir;
  auto cfg = nn::ModelConfig::from_name("d2");
  cfg.max_seq_len = 64;
  auto model = nn::make_model(cfg);
  model->init_weights(test::fresh_seed());
  io::save_llmc_model(dir.file("gpt2.bin"), *model);
  const std::string exe = LOOM_EXPORT_EXE;
  // A synthetic GPT-2 vocabulary: vocab.json and merges.txt are its files byte for byte.
  fs::create_directories(dir.file("vocab"));
  std::string enc = "{";
  for (int i = 0; i < 50257; ++i) enc += (i ? ", " : "") + std::string("\"t") + std::to_string(i) + "\": " + std::to_string(i);
  enc += "}";
  test::write_all(dir.file("vocab/encoder.json"), enc);
  test::write_all(dir.file("vocab/vocab.bpe"), "#version: 0.2\nt 1\n");
  AppRun r = run(exe, "--checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.file("out") + " --max-shard-size 300KB" +
                          " --tokenizer-path " + dir.file("vocab"));
  ASSERT_EQ(r.status, 0) << r.all;
  EXPECT_EQ(test::read_all(dir.file("out/vocab.json")), enc);
  EXPECT_EQ(test::read_all(dir.file("out/merges.txt")), "#version: 0.2\nt 1\n");
  EXPECT_TRUE(fs::exists(dir.file("out/tokenizer_config.json")));
  io::HfModelDir d = io::read_hf_model_dir(dir.file("out"));
  EXPECT_TRUE(d.sharded);
  EXPECT_GE(d.weight_files.size(), 3u);
  for (const auto& f : d.weight_files) {  // within the limit (and a header), or one tensor bigger than it (wte)
    const auto n = io::load_safetensors(dir.file("out/" + f)).size();
    EXPECT_TRUE(fs::file_size(dir.file("out/" + f)) <= 300000u + 10000u || n == 1) << f;
  }
  auto back = io::load_hf_model(dir.file("out"));
  auto want = model->hf_state_dict(), got = back->hf_state_dict();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(test::bytes_equal(got[i].second, want[i].second)) << want[i].first;
  // LLaMA: tokenizer files given are copied; none given is said.
  auto llama = nn::make_model(tiny_llama());
  llama->init_weights(2);
  io::save_hf_model_dir(dir.file("llama"), *llama, {});
  fs::create_directories(dir.file("tok/original"));
  test::write_all(dir.file("tok/tokenizer.json"), "{\"version\": \"1.0\"}");
  test::write_all(dir.file("tok/original/tokenizer.model"), "abc 0\n");
  r = run(exe, "--checkpoint " + dir.file("llama") + " --hf " + dir.file("llama2") + " --tokenizer-path " +
                   dir.file("tok") + " --dtype bf16");
  ASSERT_EQ(r.status, 0) << r.all;
  EXPECT_EQ(test::read_all(dir.file("llama2/tokenizer.json")), "{\"version\": \"1.0\"}");
  EXPECT_EQ(test::read_all(dir.file("llama2/original/tokenizer.model")), "abc 0\n");
  EXPECT_NE(test::read_all(dir.file("llama2/config.json")).find("\"bfloat16\""), std::string::npos);
  r = run(exe, "--checkpoint " + dir.file("llama") + " --hf " + dir.file("llama3"));
  ASSERT_EQ(r.status, 0) << r.all;
  EXPECT_NE(r.out.find("no tokenizer files given"), std::string::npos) << r.out;
  // Errors: onto the input, over files, a bad size, nothing to write, an input that is not a model.
  expect_one_line_error(exe, "--checkpoint " + dir.file("llama") + " --hf " + dir.file("llama"), "input");
  expect_one_line_error(exe, "--checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.path().string(), "input");
  expect_one_line_error(exe, "--checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.file("out"), "--force");
  expect_one_line_error(exe, "--checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.file("o2") +
                                 " --max-shard-size 5XB", "--max-shard-size");
  expect_one_line_error(exe, "--checkpoint " + dir.file("gpt2.bin"), "nothing to write");
  expect_one_line_error(exe, "--checkpoint " + dir.file("vocab") + " --hf " + dir.file("o3"), "config.json");
  EXPECT_FALSE(fs::exists(dir.file("o2")));
  // --force replaces the old weights.
  r = run(exe, "--checkpoint " + dir.file("gpt2.bin") + " --hf " + dir.file("out") + " --force --tokenizer-path " +
                   dir.file("vocab"));
  ASSERT_EQ(r.status, 0) << r.all;
  EXPECT_FALSE(io::read_hf_model_dir(dir.file("out")).sharded);
  EXPECT_FALSE(fs::exists(dir.file("out/model.safetensors.index.json")));
}

// A LoRA checkpoint: --peft writes the adapter directory, --merge-lora the merged model (the adapters folded in), and
// --hf without --merge-lora is one line.
TEST(LoomExport, LoraCheckpointAsPeftDirectoryAndMerged) {
  TempDir dir;
  nn::ModelConfig c = tiny_llama();
  c.lora.rank = 4;
  c.lora.targets = {"q", "v"};
  auto model = nn::make_model(c, 3);
  {
    autograd::NoGradGuard ng;
    for (auto& [name, p] : model->lora_parameters()) p.copy_from(test::random_tensor(p.shape(), kF32, -0.2, 0.2, 9));
  }
  io::TensorMap tensors;
  for (auto& [name, p] : model->named_parameters()) tensors["model." + name] = p.detach();
  io::save_safetensors(dir.file("ck.safetensors"), tensors, {{"format", "loom-checkpoint-1"}, {"config", c.to_json()}});
  const std::string exe = LOOM_EXPORT_EXE, ck = "--checkpoint " + dir.file("ck.safetensors");
  expect_one_line_error(exe, ck + " --hf " + dir.file("plain"), "--merge-lora");
  AppRun r = run(exe, ck + " --peft " + dir.file("adapter") + " --merge-lora --hf " + dir.file("merged"));
  ASSERT_EQ(r.status, 0) << r.all;
  EXPECT_TRUE(fs::exists(dir.file("adapter/adapter_config.json")));
  EXPECT_EQ(io::load_safetensors(dir.file("adapter/adapter_model.safetensors")).size(), size_t(2 * 2 * c.n_layer));
  auto merged = io::load_hf_model(dir.file("merged"));
  EXPECT_FALSE(merged->config().lora.enabled());
  autograd::NoGradGuard ng;
  Tensor idx = test::random_indices({1, 7}, 0, c.vocab_size, kI64, 4);
  nn::Module::EvalScope e1(*model), e2(*merged);
  EXPECT_TRUE(test::all_close(ops::narrow(merged->forward(idx), 2, 0, c.vocab_size),
                              ops::narrow(model->forward(idx), 2, 0, c.vocab_size), 1e-4, 1e-4));
  nn::ModelConfig plain = c;
  plain.lora.rank = 0;
  io::save_hf_model_dir(dir.file("base"), *nn::make_model(plain, 3), {});
  expect_one_line_error(exe, "--checkpoint " + dir.file("base") + " --peft " + dir.file("a2"), "holds no LoRA adapters");
}
#endif

}  // namespace
}  // namespace loom
