// Text generation: a KV-cached decoding loop over any LanguageModel, with greedy, temperature, top-k and top-p
// sampling, a repetition penalty, stop tokens and stop strings, and several samples of one prompt.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

#include "loom/autograd/grad_mode.h"
#include "loom/nn/model.h"

namespace loom::nn {

int32_t sample_token(const std::vector<double>& l, const GenerateOptions& opts, std::mt19937_64& rng) {
  LOOM_REQUIRE(!l.empty(), "sample_token: no logits");
  LOOM_REQUIRE(opts.top_k >= 0, "generate: top_k must be >= 0, got ", opts.top_k);
  LOOM_REQUIRE(opts.top_p > 0 && opts.top_p <= 1, "generate: top_p must be in (0, 1], got ", opts.top_p);
  LOOM_REQUIRE(std::isfinite(opts.temperature), "generate: temperature must be finite, got ", opts.temperature);
  if (opts.temperature <= 0) return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t k = opts.top_k > 0 ? std::min<size_t>(size_t(opts.top_k), l.size()) : l.size();
  // Most likely first, the lower id first among equals (a deterministic order for top-k/top-p cuts).
  std::partial_sort(order.begin(), order.begin() + int64_t(k), order.end(), [&](int32_t a, int32_t b) {
    return l[size_t(a)] > l[size_t(b)] || (l[size_t(a)] == l[size_t(b)] && a < b);
  });
  const double mx = l[size_t(order[0])];
  std::vector<double> w(k);
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += w[i] = std::exp((l[size_t(order[i])] - mx) / opts.temperature);
  size_t keep = k;
  if (opts.top_p < 1) {  // the fewest leading tokens whose probability reaches top_p (at least one)
    double cum = 0;
    for (keep = 0; keep < k;) {
      cum += w[keep++] / sum;
      if (cum >= opts.top_p) break;
    }
  }
  std::discrete_distribution<size_t> dist(w.begin(), w.begin() + int64_t(keep));
  return order[dist(rng)];
}

void apply_repetition_penalty(std::vector<double>& logits, const std::vector<int32_t>& seen, double penalty) {
  LOOM_REQUIRE(std::isfinite(penalty) && penalty > 0, "generate: repetition_penalty must be a finite number > 0, got ",
               penalty);
  if (penalty == 1) return;
  std::unordered_set<int32_t> done;
  for (int32_t t : seen) {
    if (t < 0 || size_t(t) >= logits.size() || !done.insert(t).second) continue;
    double& x = logits[size_t(t)];
    x = x < 0 ? x * penalty : x / penalty;
  }
}

std::vector<int32_t> generate(LanguageModel& model, const std::vector<int32_t>& prompt, const GenerateOptions& opts) {
  Module::EvalScope eval(model);
  return generate([&](const Tensor& idx, std::vector<KVCache>* caches) { return model.forward(idx, caches); },
                  model.config(), model.parameters().front().device(), prompt, opts);
}

std::vector<int32_t> generate(const LogitsFn& forward, const ModelConfig& cfg, Device device,
                              const std::vector<int32_t>& prompt, const GenerateOptions& opts) {
  LOOM_REQUIRE(!prompt.empty(), "generate: the prompt is empty");
  LOOM_REQUIRE(opts.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ", opts.max_new_tokens);
  for (int32_t t : prompt)
    LOOM_REQUIRE(t >= 0 && t < cfg.vocab_size, "generate: prompt token ", t, " is outside the vocabulary of ",
                 cfg.vocab_size);
  LOOM_REQUIRE(std::isfinite(opts.repetition_penalty) && opts.repetition_penalty > 0,
               "generate: repetition_penalty must be a finite number > 0, got ", opts.repetition_penalty);
  size_t longest_stop = 0;
  for (const std::string& s : opts.stop_strings) {
    LOOM_REQUIRE(!s.empty(), "generate: a stop string is empty");
    longest_stop = std::max(longest_stop, s.size());
  }
  LOOM_REQUIRE(opts.stop_strings.empty() || opts.decode, "generate: stop strings need a decode function");
  const std::unordered_set<int32_t> stop_tokens(opts.stop_tokens.begin(), opts.stop_tokens.end());
  autograd::NoGradGuard ng;
  std::mt19937_64 rng(opts.seed);
  std::string text;  // of the new tokens, while there are stop strings to look for
  std::vector<int32_t> tokens = prompt;
  std::vector<KVCache> caches;
  bool use_cache = opts.use_kv_cache;
  size_t fed = 0;  // tokens already in the caches
  for (int64_t step = 0; step < opts.max_new_tokens; ++step) {
    if (int64_t(tokens.size()) >= cfg.max_seq_len) use_cache = false;  // past the context: slide a window instead
    std::vector<int32_t> input;
    if (use_cache) {
      input.assign(tokens.begin() + int64_t(fed), tokens.end());
    } else {
      size_t start = tokens.size() > size_t(cfg.max_seq_len) ? tokens.size() - size_t(cfg.max_seq_len) : 0;
      input.assign(tokens.begin() + int64_t(start), tokens.end());
    }
    Tensor idx = from_vector(input, {1, int64_t(input.size())}, device);
    Tensor logits = forward(idx, use_cache ? &caches : nullptr);
    fed = tokens.size();
    Tensor last = ops::narrow(ops::select(ops::select(logits, 0, 0), 0, logits.size(1) - 1), 0, 0, cfg.vocab_size);
    std::vector<double> scores = to_vector<double>(last);
    apply_repetition_penalty(scores, tokens, opts.repetition_penalty);
    const int32_t next = sample_token(scores, opts, rng);
    tokens.push_back(next);
    if (opts.on_token && !opts.on_token(next)) break;
    if (stop_tokens.count(next)) break;
    if (!opts.stop_strings.empty()) {
      // Only the tail can hold a stop string that this token completed.
      const size_t from = text.size() >= longest_stop ? text.size() - longest_stop + 1 : 0;
      text += opts.decode({next});
      if (std::any_of(opts.stop_strings.begin(), opts.stop_strings.end(),
                      [&](const std::string& s) { return text.find(s, from) != std::string::npos; }))
        break;
    }
  }
  return std::vector<int32_t>(tokens.begin() + int64_t(prompt.size()), tokens.end());
}

std::vector<std::vector<int32_t>> generate_samples(LanguageModel& model, const std::vector<int32_t>& prompt,
                                                   const GenerateOptions& opts, int64_t num_samples,
                                                   const std::function<void(int64_t)>& before_sample) {
  LOOM_REQUIRE(num_samples >= 1, "generate: num_samples must be at least 1, got ", num_samples);
  std::vector<std::vector<int32_t>> samples;
  GenerateOptions one = opts;
  for (int64_t i = 0; i < num_samples; ++i) {
    one.seed = opts.seed + uint64_t(i);
    if (before_sample) before_sample(i);
    samples.push_back(generate(model, prompt, one));
  }
  return samples;
}

}  // namespace loom::nn
