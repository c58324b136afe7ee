// The mixture-of-experts MLP (loom/nn/moe.h): route, permute, two grouped products around SwiGLU, combine.
#include "loom/nn/moe.h"

#include <cmath>
#include <map>
#include <string>

#include "loom/autograd/grad_mode.h"

namespace loom::nn {

MoeMLP::MoeMLP(int64_t dim_, int64_t hidden_, const MoeConfig& c) : cfg(c), dim(dim_), hidden(hidden_) {
  LOOM_REQUIRE(c.enabled() && c.top_k >= 1 && c.top_k <= c.num_experts, "MoeMLP: top ", c.top_k, " of ",
               c.num_experts, " experts");
  gate = register_module("gate", std::make_shared<Linear>(dim, c.num_experts, false));
  experts = register_module("experts", std::make_shared<Module>());
  // LibTorch's Linear initialization per expert, as the per-expert layout's nn.Linear would be: U(-1/sqrt(in), ..).
  const double up_bound = 1.0 / std::sqrt(double(dim)), down_bound = 1.0 / std::sqrt(double(hidden));
  gate_up_proj = experts->register_parameter(
      "gate_up_proj", SkipInit::active() ? zeros({c.num_experts, 2 * hidden, dim})
                                         : rand({c.num_experts, 2 * hidden, dim}, kF32, Device(), nullptr, -up_bound,
                                                up_bound));
  down_proj = experts->register_parameter(
      "down_proj", SkipInit::active() ? zeros({c.num_experts, dim, hidden})
                                      : rand({c.num_experts, dim, hidden}, kF32, Device(), nullptr, -down_bound,
                                             down_bound));
  if (c.shared_expert_hidden > 0)
    shared_expert = register_module("shared_expert", std::make_shared<SwiGLUMLP>(dim, c.shared_expert_hidden));
}

Tensor MoeMLP::forward(const Tensor& x) const {
  LOOM_REQUIRE(x.dim() >= 1 && x.size(-1) == dim, "MoeMLP: expected [..., ", dim, "], got ", describe(x));
  Shape shape = x.shape();
  return forward_tokens(x.reshape({-1, dim})).reshape(shape);
}

Tensor MoeMLP::forward_tokens(const Tensor& x) const {
  const int64_t N = x.size(0), E = cfg.num_experts, k = cfg.top_k;
  const bool training = is_training();
  Tensor h = x;
  if (training && cfg.jitter_noise > 0)  // Hugging Face Mixtral's router jitter: the experts see it too
    h = mul(h, rand(h.shape(), h.dtype(), h.device(), nullptr, 1.0 - cfg.jitter_noise, 1.0 + cfg.jitter_noise));
  Tensor logits = linear(h, gate->weight);  // the router stays out of an FP8 scope (routing is decided on it)
  MoeRouting route = moe_route(logits, k, cfg.renormalize);
  const int64_t capacity =
      cfg.capacity_factor > 0 ? int64_t(std::ceil(cfg.capacity_factor * double(N * k) / double(E))) : -1;
  ops::MoePermutation perm = moe_permute(h, route.experts, E, capacity);
  const std::vector<int64_t> sizes = ops::group_sizes_of(perm.counts);  // one small copy to the host
  Tensor y = run_experts(perm.out, sizes);  // [N k, C]
  Tensor out = moe_unpermute(y, perm, route.weights);
  if (shared_expert) out = add(out, shared_expert->forward(h));

  if (log && training) {
    int64_t kept = 0;
    for (int64_t s : sizes) kept += s;
    log->assignments += N * k;
    log->dropped += N * k - kept;
    if ((cfg.aux_loss_coef > 0 || cfg.z_loss_coef > 0) && N > 0) {
      RouterLog::Layer layer;
      Tensor counts = perm.counts;
      if (capacity >= 0) {  // f counts every assignment, dropped ones included
        Tensor ex = ops::contiguous(route.experts.to(Device()));
        Tensor all = zeros({E}, kI64);
        const int64_t* e = static_cast<const int64_t*>(ex.data());
        int64_t* c = static_cast<int64_t*>(all.data());
        for (int64_t a = 0; a < ex.numel(); ++a) ++c[e[a]];
        counts = all.to(x.device());
      }
      const DType stats = route.probs.dtype();  // f32, f64 for an f64 model
      layer.fraction = ops::mul(ops::to_dtype(counts, stats), 1.0 / double(N));
      layer.mean_prob = mean(route.probs, {0});
      if (cfg.z_loss_coef > 0) {
        Tensor l = logits.dtype() == stats ? logits : loom::to(logits, stats);
        Tensor m = ops::max(l.detach(), {1}, true);
        Tensor lse = add(loom::log(sum(exp(sub(l, m)), {1})), m.reshape({N}));
        layer.z = mean(mul(lse, lse));
      }
      log->layers.push_back(layer);
    }
  }
  return out;
}

Tensor MoeMLP::local_experts(const Tensor& rows, const std::vector<int64_t>& sizes) const {
  auto product = [&](const Tensor& x, const Tensor& w, const std::shared_ptr<fp8::LinearState>& fp8) {
    return fp8 ? fp8::grouped_linear(x, w, sizes, fp8) : grouped_gemm(x, w, sizes, true);
  };
  Tensor gate_up = product(rows, gate_up_proj, gate_up_fp8);  // [rows, 2F]
  std::vector<Tensor> halves = split(gate_up, hidden, 1);
  // Under FP8 the activation is quantized where it is made (fp8::grouped_swiglu_linear).
  if (down_fp8) return fp8::grouped_swiglu_linear(halves[0], halves[1], down_proj, sizes, down_fp8);  // [rows, C]
  return grouped_gemm(swiglu(halves[0], halves[1]), down_proj, sizes, true);
}

// Under expert parallelism rank r holds experts [r L, (r + 1) L). The rows of its tokens go, expert group by expert
// group, to the ranks holding those experts; each rank runs its experts over what it received (reordered from
// (source rank, expert) to (expert, source rank), so that each expert's rows are one group), and the results go
// back the same way. The exchanges' backward sends the gradients back along the same paths.
Tensor MoeMLP::run_experts(const Tensor& rows, const std::vector<int64_t>& sizes) const {
  if (!expert_parallel || expert_parallel->size() == 1) return local_experts(rows, sizes);
  const int R = expert_parallel->size();
  const int64_t E = cfg.num_experts, L = E / R, total = rows.size(0);
  LOOM_REQUIRE(E % R == 0 && gate_up_proj.size(0) == L, "MoeMLP: ", E, " experts over ", R,
               " expert-parallel ranks, but this rank holds ", gate_up_proj.size(0));
  std::vector<int64_t> send_rows(size_t(R), 0);
  int64_t kept = 0;
  for (int64_t e = 0; e < E; ++e) send_rows[size_t(e / L)] += sizes[size_t(e)], kept += sizes[size_t(e)];
  // got[s L + l]: the rows rank s sends for this rank's expert l.
  const std::vector<int64_t> got = expert_parallel->exchange_counts(sizes);
  std::vector<int64_t> recv_rows(size_t(R), 0), local_sizes(size_t(L), 0), start(size_t(R * L), 0);
  int64_t received = 0;
  for (int s = 0; s < R; ++s)
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = got[size_t(s * L + l)];
      start[size_t(s * L + l)] = received;
      received += n;
      recv_rows[size_t(s)] += n;
      local_sizes[size_t(l)] += n;
    }
  Tensor sent = kept == total ? rows : narrow(rows, 0, 0, kept);
  Tensor arrived = expert_parallel->exchange_rows(sent, send_rows, recv_rows);  // by (source, expert)
  // The rows by (expert, source), and the way back.
  std::vector<int64_t> order(static_cast<size_t>(received)), back(order);
  int64_t at = 0;
  for (int64_t l = 0; l < L; ++l)
    for (int s = 0; s < R; ++s)
      for (int64_t i = 0; i < got[size_t(s * L + l)]; ++i, ++at) {
        order[size_t(at)] = start[size_t(s * L + l)] + i;
        back[size_t(start[size_t(s * L + l)] + i)] = at;
      }
  Tensor grouped = embedding(arrived, from_vector(order, {received}, rows.device()));
  Tensor y = local_experts(grouped, local_sizes);
  Tensor returned = expert_parallel->exchange_rows(embedding(y, from_vector(back, {received}, rows.device())),
                                                   recv_rows, send_rows);  // by expert, as `rows`
  if (kept == total) return returned;
  return cat({returned, zeros({total - kept, returned.size(1)}, returned.dtype(), returned.device())}, 0);
}

Tensor RouterLog::loss(const MoeConfig& cfg) const {
  if (layers.empty() || (cfg.aux_loss_coef == 0 && cfg.z_loss_coef == 0)) return Tensor();
  Tensor total;
  auto accumulate = [&](const Tensor& t) { total = total.defined() ? add(total, t) : t; };
  if (cfg.aux_loss_coef > 0) {
    std::vector<Tensor> f, p;
    for (const auto& l : layers) f.push_back(l.fraction), p.push_back(l.mean_prob);
    Tensor aux = sum(mul(mean(stack(f, 0), {0}), mean(stack(p, 0), {0})));
    accumulate(mul(aux, cfg.aux_loss_coef * double(cfg.num_experts)));
  }
  if (cfg.z_loss_coef > 0) {
    std::vector<Tensor> z;
    for (const auto& l : layers) z.push_back(l.z);
    accumulate(mul(mean(stack(z, 0)), cfg.z_loss_coef));
  }
  return total;
}

}  // namespace loom::nn

namespace loom::nn {
namespace {

bool ends_with(const std::string& s, const std::string& suffix, std::string* prefix) {
  if (s.size() < suffix.size() || s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  *prefix = s.substr(0, s.size() - suffix.size());
  return true;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> mixtral_per_expert(std::vector<std::pair<std::string, Tensor>> tensors,
                                                               int64_t num_experts) {
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : tensors) {
    std::string p;
    if (ends_with(name, ".mlp.gate.weight", &p)) {
      out.emplace_back(p + ".block_sparse_moe.gate.weight", t);
    } else if (ends_with(name, ".mlp.experts.gate_up_proj", &p)) {
      const int64_t F = t.size(1) / 2;
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string x = p + ".block_sparse_moe.experts." + std::to_string(e);
        Tensor w = ops::select(t, 0, e);
        out.emplace_back(x + ".w1.weight", ops::contiguous(ops::narrow(w, 0, 0, F)));
        out.emplace_back(x + ".w3.weight", ops::contiguous(ops::narrow(w, 0, F, F)));
      }
    } else if (ends_with(name, ".mlp.experts.down_proj", &p)) {
      for (int64_t e = 0; e < num_experts; ++e)
        out.emplace_back(p + ".block_sparse_moe.experts." + std::to_string(e) + ".w2.weight",
                         ops::contiguous(ops::select(t, 0, e)));
    } else {
      out.emplace_back(name, t);
    }
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> mixtral_fused(std::vector<std::pair<std::string, Tensor>> tensors,
                                                          int64_t num_experts) {
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  std::map<std::string, std::map<std::string, Tensor>> experts;  // layer prefix -> "N.w1" -> tensor
  std::vector<std::string> order;
  for (auto& [name, t] : tensors) {
    std::string p;
    if (ends_with(name, ".block_sparse_moe.gate.weight", &p)) {
      out.emplace_back(p + ".mlp.gate.weight", t);
      continue;
    }
    const std::string key = ".block_sparse_moe.experts.";
    const size_t at = name.find(key);
    if (at == std::string::npos) {
      out.emplace_back(name, t);
      continue;
    }
    const std::string prefix = name.substr(0, at), rest = name.substr(at + key.size());  // "N.w1.weight"
    if (!experts.count(prefix)) order.push_back(prefix);
    LOOM_REQUIRE(rest.size() > 7 && rest.compare(rest.size() - 7, 7, ".weight") == 0, "load: unexpected tensor '",
                 name, "' (expected block_sparse_moe.experts.N.w1|w2|w3.weight)");
    experts[prefix][rest.substr(0, rest.size() - 7)] = t;
  }
  for (const std::string& prefix : order) {
    auto& m = experts[prefix];
    std::vector<Tensor> gate_up, down;
    for (int64_t e = 0; e < num_experts; ++e) {
      auto get = [&](const char* w) {
        const std::string k = std::to_string(e) + "." + w;
        auto it = m.find(k);
        LOOM_REQUIRE(it != m.end(), "load: tensor '", prefix, ".block_sparse_moe.experts.", k,
                     ".weight' is missing from the checkpoint");
        return it->second;
      };
      Tensor w1 = get("w1"), w2 = get("w2"), w3 = get("w3");
      LOOM_REQUIRE(w1.dim() == 2 && w1.shape() == w3.shape() && w2.dim() == 2 && w2.size(0) == w1.size(1) &&
                       w2.size(1) == w1.size(0),
                   "load: expert ", e, " of '", prefix, "' has w1 ", shape_str(w1.shape()), ", w2 ",
                   shape_str(w2.shape()), ", w3 ", shape_str(w3.shape()), " (expected [F, C], [C, F], [F, C])");
      gate_up.push_back(ops::cat({w1, w3.to(w1.dtype())}, 0));
      down.push_back(w2);
    }
    LOOM_REQUIRE(int64_t(m.size()) == 3 * num_experts, "load: '", prefix, "' holds ", m.size(),
                 " expert tensors, the config's ", num_experts, " experts need ", 3 * num_experts);
    out.emplace_back(prefix + ".mlp.experts.gate_up_proj", stack(gate_up, 0));
    out.emplace_back(prefix + ".mlp.experts.down_proj", stack(down, 0));
  }
  return out;
}

}  // namespace loom::nn
