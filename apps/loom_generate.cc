// loom-generate: text from a trained model (a Loom checkpoint, a Hugging Face model directory or an llm.c model file),
// streamed to stdout as it is made, with a KV cache; tokens/s to stderr at the end.
//
//   loom-generate --model out/run1/checkpoints/step_000300.safetensors --prompt "ROMEO:" --max-new-tokens 100
//   echo "The meaning of life is" | loom-generate --model hf/Llama-3.2-1B --device cuda --dtype bf16 --top-p 0.9
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "loom/io/input_guard.h"
#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "loom/train/training_checkpoint.h"
#include "loom/dispatch_modes.h"
#include "loom/io/hf_model_dir.h"
#include "loom/train/checkpoint.h"
#include "loom/train/multiple_choice.h"
#include "loom/io/safetensors.h"
#include "loom/io/atomic_file.h"
#include "loom/io/read_file.h"
#include "loom/nn/finite_weights.h"
#include "loom/nn/model.h"

namespace {

using namespace loom;
namespace fs = std::filesystem;

// A prompt's bound (a file or stdin): far more text than any model's context.
constexpr uint64_t kMaxPromptBytes = uint64_t(64) << 20;

// "1, 2 3" -> {1, 2, 3}.
std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::string s = text;
  for (auto& ch : s)
    if (ch == ',') ch = ' ';
  std::istringstream in(s);
  std::string word;
  while (in >> word) {
    size_t pos = 0;
    long long v = -1;
    try {
      v = std::stoll(word, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    LOOM_REQUIRE(pos == word.size() && v >= 0 && v <= INT32_MAX, "--prompt-tokens: '", word,
                 "' is not a token id (a non-negative integer)");
    ids.push_back(int32_t(v));
  }
  LOOM_REQUIRE(!ids.empty(), "--prompt-tokens: no token ids given");
  return ids;
}

// The tokenizer as loom-train picks it (data::load_tokenizer: --tokenizer, else the model's family), looking first
// in a Hugging Face directory for its own files: GPT-2's vocab.json and merges.txt (OpenAI's encoder.json and
// vocab.bpe), LLaMA-3's tokenizer.model, else its tokenizer.json.
std::unique_ptr<data::Tokenizer> find_tokenizer(const std::string& model_path, const nn::ModelConfig& cfg,
                                                std::string name, std::string path) {
  // A Loom checkpoint records the tokenizer its run used: that one unless the command line names another.
  if (path.empty()) {
    const std::string resolved = train::resolve_checkpoint(model_path, "--model");
    if (const auto recorded = train::checkpoint_tokenizer(resolved); recorded && (name.empty() || name == recorded->name)) {
      name = recorded->name;
      path = train::recorded_tokenizer_path(resolved, *recorded);
      if (!path.empty()) std::fprintf(stderr, "loom-generate: the tokenizer the checkpoint was trained with: %s\n", path.c_str());
    }
  }
  if (name.empty()) name = cfg.family == nn::ModelFamily::kLlama ? "llama3" : "gpt2";
  if (path.empty() && io::is_hf_model_dir(model_path)) {
    const fs::path dir(model_path);
    std::error_code ec;
    if (name == "gpt2" && fs::exists(dir / "vocab.json", ec) && fs::exists(dir / "merges.txt", ec))
      return std::make_unique<data::GPT2Tokenizer>((dir / "vocab.json").string(), (dir / "merges.txt").string());
    if (name == "llama3")
      for (const char* f : {"original/tokenizer.model", "tokenizer.model"})
        if (fs::exists(dir / f, ec)) path = (dir / f).string();
    if (path.empty() && fs::exists(dir / "tokenizer.json", ec)) path = (dir / "tokenizer.json").string();
  }
  if (name == "llama3" && path.empty())
    LOOM_THROW("a LLaMA-3 model needs Meta's tokenizer.model or its tokenizer.json (--tokenizer-path; the directory "
               "has neither original/tokenizer.model nor tokenizer.json), or give token ids with --prompt-tokens");
  return data::load_tokenizer(name, path);
}

}  // namespace

int main(int argc, char** argv) {
  loom::io::protect_inputs();  // no output of this run replaces a file it read
  CLI::App app{"loom-generate: text from a Loom checkpoint, a Hugging Face model directory or an llm.c model file"};
  std::string model_path, prompt, prompt_file, prompt_tokens, device_name = "cpu", dtype_name = "f32";
  std::string tokenizer_name, tokenizer_path, dump_logits;
  nn::GenerateOptions g;
  g.max_new_tokens = 128;
  bool greedy = false, no_cache = false, print_tokens = false, no_echo = false, ignore_eos = false;
  int64_t num_samples = 1;
  app.add_option("-m,--model,--checkpoint", model_path,
                 "a Loom training checkpoint (.safetensors, a distributed run's sharded step directory, or a run's "
                 "checkpoint directory, whose latest is taken), a Hugging Face model directory (config.json + "
                 "safetensors) or an llm.c GPT-2 model file (.bin)")
      ->required();
  auto* p_opt = app.add_option("-p,--prompt", prompt, "the prompt text (default: --prompt-file, else stdin)");
  auto* f_opt = app.add_option("--prompt-file", prompt_file, "read the prompt from this file");
  auto* t_opt = app.add_option("--prompt-tokens", prompt_tokens,
                               "the prompt as token ids (\"1,2,3\"), no tokenizer needed; the output is then ids");
  p_opt->excludes(f_opt)->excludes(t_opt);
  f_opt->excludes(t_opt);
  app.add_option("-n,--max-new-tokens", g.max_new_tokens, "tokens to generate")->capture_default_str();
  app.add_option("--temperature", g.temperature, "sampling temperature (0: greedy)")->capture_default_str();
  app.add_option("--top-k", g.top_k, "sample among the k most likely tokens (0: all)")->capture_default_str();
  app.add_option("--top-p", g.top_p, "then among the fewest most likely tokens whose probability reaches p (1: all)")
      ->capture_default_str();
  app.add_option("--seed", g.seed, "random seed of the sampling")->capture_default_str();
  app.add_option("--repetition-penalty", g.repetition_penalty,
                 "divide the positive logits of tokens already in the text by P and multiply the negative ones (1: off; "
                 "as transformers' repetition_penalty)")
      ->capture_default_str();
  app.add_option("--num-samples", num_samples, "samples of the prompt, sample i with seed --seed + i")
      ->capture_default_str();
  app.add_flag("--ignore-eos", ignore_eos,
               "go on past the tokenizer's end-of-text token (GPT-2's <|endoftext|>, LLaMA-3's <|end_of_text|> and "
               "<|eot_id|>), where a sample otherwise stops");
  app.add_option("--stop", g.stop_strings, "stop a sample once its new text contains this string (repeatable)");
  app.add_flag("--greedy", greedy, "always take the most likely token (same as --temperature 0)");
  app.add_flag("--no-kv-cache", no_cache, "recompute the whole sequence for every token (slow; for checking)");
  app.add_option("--device", device_name, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", dtype_name, "weights: f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--tokenizer", tokenizer_name, "gpt2 or llama3 (default: the model's)")
      ->check(CLI::IsMember({"gpt2", "llama3"}));
  app.add_option("--tokenizer-path", tokenizer_path,
                 "a Hugging Face tokenizer.json (byte-level BPE, whatever --tokenizer says); gpt2: the directory of encoder.json and vocab.bpe (default: a Hugging Face directory's vocab.json "
                 "and merges.txt, else $LOOM_CACHE_DIR/gpt2 or ~/.cache/loom/gpt2); llama3: Meta's tokenizer.model "
                 "(default: a Hugging Face directory's original/tokenizer.model, else its tokenizer.json)");
  app.add_flag("--print-tokens", print_tokens, "print the new token ids instead of text");
  app.add_flag("--no-echo", no_echo, "print only the new text, not the prompt before it");
  std::string hellaswag;
  int64_t max_items = 0;
  app.add_option("--hellaswag", hellaswag,
                 "instead of generating, score a multiple-choice file in HellaSwag's JSON Lines format (ctx, endings, "
                 "label; e.g. hellaswag_val.jsonl) as llm.c does: the ending of least loss given the context, by "
                 "total (acc) and mean per token (acc_norm)");
  app.add_option("--max-items", max_items, "with --hellaswag: score only the first N items (default: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dump-logits", dump_logits,
                 "write the prompt's logits [T, vocab] (f32, safetensors tensor \"logits\") to this file first; for "
                 "comparing with other implementations (tools/reference/hf_check.py)");
  cli::output_options(app, {"--dump-logits"});
  if (int rc = cli::parse(app, "loom-generate", argc, argv); rc >= 0) return rc;
  try {
    LOOM_REQUIRE(g.max_new_tokens >= 0, "--max-new-tokens must be at least 0, got ", g.max_new_tokens);
    LOOM_REQUIRE(std::isfinite(g.temperature) && g.temperature >= 0, "--temperature must be a finite number >= 0, got ",
                 apps::exact_number(g.temperature));
    LOOM_REQUIRE(g.top_k >= 0, "--top-k must be at least 0, got ", g.top_k);
    LOOM_REQUIRE(g.top_p > 0 && g.top_p <= 1, "--top-p must be in (0, 1], got ", apps::exact_number(g.top_p));
    LOOM_REQUIRE(std::isfinite(g.repetition_penalty) && g.repetition_penalty > 0,
                 "--repetition-penalty must be a finite number > 0, got ",
                 apps::exact_number(g.repetition_penalty));
    LOOM_REQUIRE(num_samples >= 1, "--num-samples must be at least 1, got ", num_samples);
    for (const std::string& stop : g.stop_strings) LOOM_REQUIRE(!stop.empty(), "--stop: the string is empty");
    LOOM_REQUIRE(g.stop_strings.empty() || prompt_tokens.empty(),
                 "--stop needs a tokenizer to read the text: not with --prompt-tokens");
    if (greedy) g.temperature = 0;
    g.use_kv_cache = !no_cache;
    const Device device = Device::parse(device_name);

    std::shared_ptr<nn::LanguageModel> model = train::load_model_from(model_path, "--model");
    const nn::ModelConfig& cfg = model->config();
    nn::check_finite_parameters(*model, model_path);

    if (!hellaswag.empty()) {
      LOOM_REQUIRE(prompt.empty() && prompt_file.empty() && prompt_tokens.empty() && dump_logits.empty(),
                   "--hellaswag scores its file's items: not with a prompt or --dump-logits");
      const std::vector<train::MultipleChoiceItem> items = train::read_multiple_choice(hellaswag, max_items);
      const std::unique_ptr<data::Tokenizer> tok = find_tokenizer(model_path, cfg, tokenizer_name, tokenizer_path);
      dispatch::check_op_profile_file();
      model->to(device);
      if (dtype_name == "bf16") model->to(kBF16);
      std::fprintf(stderr, "loom-generate: %s: %s, %s %s; %zu items of %s\n", model_path.c_str(),
                   cfg.describe().c_str(), device.str().c_str(), dtype_name.c_str(), items.size(), hellaswag.c_str());
      const auto start = std::chrono::steady_clock::now();
      auto last = start;
      const train::MultipleChoiceScore score = train::evaluate_multiple_choice(
          *model, *tok, items, device, [&](int64_t done, const train::MultipleChoiceScore& s) {
            const auto now = std::chrono::steady_clock::now();
            if (now - last < std::chrono::seconds(10) && done != int64_t(items.size())) return;
            last = now;
            std::fprintf(stderr, "loom-generate: hellaswag %lld/%zu items, acc_norm %.4f, %.0f s\n", (long long)done,
                         items.size(), double(s.correct_mean) / double(done),
                         std::chrono::duration<double>(now - start).count());
          });
      std::printf("hellaswag: %lld items | acc %.4f (%lld by total loss) | acc_norm %.4f (%lld by mean loss per "
                  "token)%s\n",
                  (long long)score.items, double(score.correct_total) / double(score.items),
                  (long long)score.correct_total, double(score.correct_mean) / double(score.items),
                  (long long)score.correct_mean,
                  score.truncated ? (" | " + std::to_string(score.truncated) + " contexts cut to fit").c_str() : "");
      return 0;
    }
    std::vector<int32_t> ids;
    std::unique_ptr<data::Tokenizer> tokenizer;
    if (!prompt_tokens.empty()) {
      ids = parse_token_ids(prompt_tokens);
      print_tokens = true;
    } else {
      if (!prompt_file.empty()) {
        prompt = io::read_input_file(prompt_file, kMaxPromptBytes, "--prompt-file");
      } else if (p_opt->count() == 0) {  // stdin, within the same bound (an endless pipe is not read to the end)
        char buf[1 << 16];
        while (std::cin.read(buf, sizeof buf) || std::cin.gcount() > 0) {
          prompt.append(buf, size_t(std::cin.gcount()));
          LOOM_REQUIRE(prompt.size() <= kMaxPromptBytes, "the prompt on stdin is more than ",
                       io::byte_size_text(double(kMaxPromptBytes)), " (no model's context holds that much)");
        }
      }
      tokenizer = find_tokenizer(model_path, cfg, tokenizer_name, tokenizer_path);
      LOOM_REQUIRE(tokenizer->vocab_size() <= cfg.vocab_size, "the ", tokenizer->name(), " tokenizer's ",
                   tokenizer->vocab_size(), " tokens do not fit the model's vocabulary of ", cfg.vocab_size,
                   " (--tokenizer/--tokenizer-path do not match the model)");
      ids = data::encode_prompt(*tokenizer, prompt);
      if (!ignore_eos) g.stop_tokens = tokenizer->end_tokens();
      g.decode = [&](const std::vector<int32_t>& t) { return tokenizer->decode(t); };
    }
    for (int32_t t : ids)
      LOOM_REQUIRE(t < cfg.vocab_size, "prompt token ", t, " is outside the model's vocabulary of ", cfg.vocab_size);
    LOOM_REQUIRE(int64_t(ids.size()) < cfg.max_seq_len, "the prompt's ", ids.size(),
                 " tokens fill the model's context of ", cfg.max_seq_len);

    // Every input is read and noted now: the output is checked before the work, and written atomically after it.
    io::check_can_write(dump_logits, "--dump-logits");
    dispatch::check_op_profile_file();
    model->to(device);
    if (dtype_name == "bf16") model->to(kBF16);  // parameters only: the rope tables stay f32
    std::fprintf(stderr, "loom-generate: %s: %s, %s %s\n", model_path.c_str(), cfg.describe().c_str(),
                 device.str().c_str(), dtype_name.c_str());

    if (!dump_logits.empty()) {  // one forward over the prompt, without the cache
      autograd::NoGradGuard ng;
      model->eval();
      Tensor logits = model->forward(from_vector(ids, {1, int64_t(ids.size())}, device));
      logits = ops::narrow(ops::select(logits, 0, 0), 1, 0, cfg.vocab_size).to(kF32);
      io::save_safetensors(dump_logits, {{"logits", logits}});
    }
    int64_t made = 0;
    std::vector<int32_t> out;
    const auto start = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point first;
    int64_t sample_made = 0;
    g.on_token = [&](int32_t t) {
      if (made++ == 0) first = std::chrono::steady_clock::now();
      if (print_tokens) {
        std::cout << (sample_made++ > 0 ? " " : "") << t;
      } else if (std::find(g.stop_tokens.begin(), g.stop_tokens.end(), t) == g.stop_tokens.end()) {
        const int32_t one[1] = {t};
        std::cout << tokenizer->decode(one);
      }
      std::cout.flush();
      return true;
    };
    nn::generate_samples(*model, ids, g, num_samples, [&](int64_t i) {
      if (i > 0) std::cout << "\n";
      if (num_samples > 1) std::cout << "--- sample " << i + 1 << " of " << num_samples << " ---\n";
      if (!no_echo && !print_tokens) std::cout << prompt;
      sample_made = 0;
      std::cout.flush();
    });
    const auto end = std::chrono::steady_clock::now();
    std::cout << std::endl;
    const double total_s = std::chrono::duration<double>(end - start).count();
    const double prefill_s = made > 0 ? std::chrono::duration<double>(first - start).count() : total_s;
    const double decode_s = total_s - prefill_s;
    std::fprintf(stderr,
                 "loom-generate: %lld prompt tokens, %lld new tokens in %.3f s (first token %.3f s; %.1f tokens/s "
                 "after it)\n",
                 (long long)ids.size(), (long long)made, total_s, prefill_s,
                 made > 1 && decode_s > 0 ? double(made - 1) / decode_s : 0.0);
  } catch (const std::exception& e) {
    std::cout.flush();
    cli::print_error("loom-generate", loom::apps::error_text(e));
    return 1;
  } catch (...) {
    std::cout.flush();
    cli::print_error("loom-generate", "an unexpected error that is not a std::exception");
    return 1;
  }
  return 0;
}
