// Text generation: a KV-cached decoding loop over any LanguageModel, with greedy, temperature, top-k and top-p
// sampling.
#include <algorithm>
#include <cmath>
#include <numeric>

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
  autograd::NoGradGuard ng;
  std::mt19937_64 rng(opts.seed);
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
    const int32_t next = sample_token(to_vector<double>(last), opts, rng);
    tokens.push_back(next);
    if (opts.on_token && !opts.on_token(next)) break;
  }
  return std::vector<int32_t>(tokens.begin() + int64_t(prompt.size()), tokens.end());
}

}  // namespace loom::nn
