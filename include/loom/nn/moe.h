// A mixture-of-experts MLP for LLaMA-family blocks (Mixtral's layout): a linear router over E SwiGLU experts, each
// token taking its top k, the experts run as grouped matrix products over the tokens permuted into expert groups.
// Parameters, by Hugging Face's fused names (transformers 5): gate.weight [E, C], experts.gate_up_proj [E, 2F, C]
// (each expert's gate rows then its up rows), experts.down_proj [E, C, F]; and shared_expert.{gate,up,down}_proj when
// the config has a shared expert.
#pragma once

#include <limits>
#include <memory>
#include <vector>

#include "loom/moe.h"
#include "loom/nn/layers.h"
#include "loom/nn/model.h"

namespace loom::nn {

// What the routers of a model's MoE blocks did: the terms of the auxiliary losses of the last training forward (kept
// with their graphs so their gradients reach the routers), and counts over the training forwards since they were
// last taken (LanguageModel::take_router_stats).
struct RouterLog {
  struct Layer {
    // In the router's statistics dtype: f32 (f64 for an f64 model).
    Tensor fraction;   // f_e: the assignments to each expert over the tokens [E] (no gradient)
    Tensor mean_prob;  // P_e: each expert's mean router probability [E] (differentiable)
    Tensor z;          // the mean of logsumexp(logits)^2 (a scalar, differentiable), when the z-loss is on
  };
  std::vector<Layer> layers;  // this forward's, one per MoE block
  int64_t assignments = 0;    // tokens times top_k, over the layers and forwards
  int64_t dropped = 0;        // of them, dropped by the capacity
  Tensor loss_total;          // the forwards' auxiliary losses summed (detached, on the model's device)
  int64_t losses = 0;         // how many are in loss_total
  void clear() { *this = RouterLog(); }
  // aux_coef * E * sum_e mean_l(f_e) mean_l(P_e) + z_coef * mean_l(z), as one scalar (Hugging Face's
  // load-balancing loss over every layer's tokens); undefined when nothing was logged or both coefficients are 0.
  Tensor loss(const MoeConfig& cfg) const;
};

// The routers over the training forwards since the last take: the mean auxiliary loss (NaN when it is off) and the
// assignments the capacity dropped.
struct RouterStats {
  double aux_loss = std::numeric_limits<double>::quiet_NaN();
  int64_t assignments = 0, dropped = 0;
};

// What an MoE layer whose experts are split across the ranks of an expert-parallel group needs from the others. nn
// names only this interface: the one Mixtral definition runs split when a plan (loom/distributed/expert_parallel.h)
// has cut its experts to this rank's and handed the layer a region, and whole without one.
class ExpertParallelRegion {
 public:
  virtual ~ExpertParallelRegion() = default;
  virtual int rank() const = 0;  // this rank holds experts [rank * local, (rank + 1) * local)
  virtual int size() const = 0;
  // Each rank's counts[r] (a vector of size() x n values, n per destination rank) -> the n values every rank sent
  // this one, in rank order (size() x n). Not differentiable.
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) const = 0;
  // Rows [sum(send_rows), C] -> rows [sum(recv_rows), C]: send_rows[r] rows to rank r, recv_rows[r] rows from rank r,
  // in rank order. Differentiable: the backward sends the gradient back the way the rows came.
  virtual Tensor exchange_rows(const Tensor& rows, const std::vector<int64_t>& send_rows,
                               const std::vector<int64_t>& recv_rows) const = 0;
};

class MoeMLP : public Module {
 public:
  MoeMLP(int64_t dim, int64_t hidden, const MoeConfig& cfg);
  // x [..., C] -> [..., C]. In training mode logs its router terms into `log` when set.
  Tensor forward(const Tensor& x) const;
  Tensor forward_tokens(const Tensor& x) const;  // x [N, C]
  MoeConfig cfg;
  int64_t dim, hidden;
  std::shared_ptr<Linear> gate;         // the router, [E, C]
  std::shared_ptr<Module> experts;      // holds gate_up_proj and down_proj
  Tensor gate_up_proj, down_proj;       // [E, 2F, C], [E, C, F]
  std::shared_ptr<SwiGLUMLP> shared_expert;  // or null
  std::shared_ptr<RouterLog> log;
  // Set (by a model's FP8 scope over its blocks): the experts' two grouped products run in FP8 (fp8::grouped_linear)
  // with these scalings. The router stays in the autocast dtype: routing is decided on its logits.
  std::shared_ptr<fp8::LinearState> gate_up_fp8, down_fp8;
  // Expert parallelism: set by a plan that kept this rank's experts (gate_up_proj and down_proj then hold
  // num_experts / region->size() experts); the router still scores every expert on every rank.
  std::shared_ptr<const ExpertParallelRegion> expert_parallel;

 protected:
  void mode_changed(bool training) override {
    for (const auto& state : {gate_up_fp8, down_fp8})
      if (state) state->set_training(training);
  }

 private:
  // The experts over tokens permuted into groups of every expert (sizes: rows per expert, num_experts of them):
  // here, or on the ranks that hold them.
  Tensor run_experts(const Tensor& rows, const std::vector<int64_t>& sizes) const;
  Tensor local_experts(const Tensor& rows, const std::vector<int64_t>& sizes) const;
};

// A Mixtral state dict by transformers 5's fused names (Loom's parameter names) as the per-expert layout Mixtral-8x7B
// ships (block_sparse_moe.gate, block_sparse_moe.experts.N.w1|w2|w3, Linear [out, in] each), which transformers 4
// and 5 both read; other names pass through.
std::vector<std::pair<std::string, Tensor>> mixtral_per_expert(std::vector<std::pair<std::string, Tensor>> tensors,
                                                               int64_t num_experts);
// The reverse, for loading: per-expert names fused into Loom's; fused names (mlp.gate, mlp.experts.gate_up_proj,
// mlp.experts.down_proj) pass through. Throws naming a missing or misshapen expert tensor.
std::vector<std::pair<std::string, Tensor>> mixtral_fused(std::vector<std::pair<std::string, Tensor>> tensors,
                                                          int64_t num_experts);

}  // namespace loom::nn
