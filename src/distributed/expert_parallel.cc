// Expert parallelism: the all-to-all exchange of rows as an autograd node, the region the MoE layers talk through,
// and the cut of the experts to this rank's.
#include "loom/distributed/expert_parallel.h"

#include "autograd/record.h"
#include "loom/autograd/checkpoint.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"
#include "loom/nn/moe.h"

namespace loom::distributed {

namespace {

// Rows [sum(send), C] -> [sum(recv), C] (not differentiable).
Tensor all_to_all_rows(const Tensor& x, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                       ProcessGroup& group) {
  autograd::NoGradGuard ng;
  LOOM_REQUIRE(x.dim() == 2, "expert parallelism: exchanged rows must be [N, C], got ", describe(x));
  const int64_t C = x.size(1);
  std::vector<int64_t> send(send_rows.size()), recv(recv_rows.size());
  int64_t received = 0, sent = 0;
  for (size_t r = 0; r < send_rows.size(); ++r) send[r] = send_rows[r] * C, sent += send_rows[r];
  for (size_t r = 0; r < recv_rows.size(); ++r) recv[r] = recv_rows[r] * C, received += recv_rows[r];
  LOOM_REQUIRE(sent == x.size(0), "expert parallelism: ", sent, " rows to send, ", x.size(0), " given");
  Tensor in = ops::contiguous(x);
  Tensor out = empty({received, C}, x.dtype(), x.device());
  group.all_to_all(in, send, out, recv);
  return out;
}

class ExchangeRowsNode final : public autograd::Node {
 public:
  ExchangeRowsNode(std::shared_ptr<ProcessGroup> g, std::vector<int64_t> send, std::vector<int64_t> recv)
      : group_(std::move(g)), send_(std::move(send)), recv_(std::move(recv)) {}
  autograd::tensor_list apply(autograd::tensor_list&& grads) override {
    // Every rank's backward must take part, with or without a gradient here.
    Tensor g = grads[0];
    int64_t received = 0;
    for (int64_t n : recv_) received += n;
    if (!g.defined()) g = zeros({received, width_}, dtype_, device_);
    return {all_to_all_rows(g, recv_, send_, *group_)};
  }
  std::string name() const override { return "ExchangeExpertRows"; }
  int64_t width_ = 0;
  DType dtype_ = kF32;
  Device device_;

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::vector<int64_t> send_, recv_;
};

class GroupExpertRegion final : public nn::ExpertParallelRegion {
 public:
  GroupExpertRegion(std::shared_ptr<ProcessGroup> g, Device device) : group_(std::move(g)), device_(device) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) const override {
    autograd::NoGradGuard ng;
    const int R = group_->size();
    LOOM_REQUIRE(int64_t(counts.size()) % R == 0, "expert parallelism: ", counts.size(), " counts for ", R,
                 " ranks");
    const int64_t n = int64_t(counts.size()) / R;
    Tensor in = from_vector(counts, {int64_t(counts.size())}, device_);  // NCCL exchanges device memory only
    Tensor out = empty({int64_t(counts.size())}, kI64, in.device());
    group_->all_to_all(in, std::vector<int64_t>(size_t(R), n), out, std::vector<int64_t>(size_t(R), n));
    return to_vector<int64_t>(out.to(Device()));
  }
  Tensor exchange_rows(const Tensor& rows, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows) const override {
    return distributed::exchange_rows(rows, send_rows, recv_rows, group_);
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
  Device device_;
};

}  // namespace

Tensor exchange_rows(const Tensor& x, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                     const std::shared_ptr<ProcessGroup>& group) {
  // Under selective recomputation the rows are kept: the recompute does not talk to the other ranks again.
  Tensor out = autograd::kept_results("exchange_expert_rows", [&] {
    return std::vector<Tensor>{all_to_all_rows(x, send_rows, recv_rows, *group)};
  })[0];
  if (auto node = autograd::make_node<ExchangeRowsNode>({&x}, group, send_rows, recv_rows)) {
    node->width_ = x.size(1);
    node->dtype_ = x.dtype();
    node->device_ = x.device();
    autograd::set_history(out, node);
  }
  return out;
}

ExpertParallelPlan::ExpertParallelPlan(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group, Device device)
    : model_(model), group_(std::move(group)) {
  const nn::ParallelRules rules = model.parallel_rules();
  const int R = group_->size();
  LOOM_REQUIRE(rules.experts > 0 && rules.experts % R == 0, "expert parallelism: ", rules.experts,
               " experts do not divide over ", R, " ranks");
  for (auto& [name, p] : model.named_parameters())
    for (const std::string& pattern : rules.expert_parameters) {
      nn::TensorParallelRule rule;
      rule.parameter = pattern;
      if (!rule.matches(name)) continue;
      LOOM_REQUIRE(p.dim() >= 1 && p.size(0) == rules.experts, "expert parallelism: '", name, "' has shape ",
                   shape_str(p.shape()), ", expected ", rules.experts, " experts first");
      splits_[name] = ParameterSplit{true, 0, {rules.experts}};
    }
  LOOM_CHECK(!splits_.empty(), "expert parallelism: no expert weights in ", model.config().describe());
  autograd::NoGradGuard ng;
  for (auto& [name, t] : model.named_parameters()) {
    auto it = splits_.find(name);
    if (it != splits_.end()) t.set_data(shard_tensor(t.detach(), it->second, group_->rank(), R));
  }
  auto region = std::make_shared<GroupExpertRegion>(group_, device);
  for (auto& [name, m] : model.named_modules())
    if (auto moe = std::dynamic_pointer_cast<nn::MoeMLP>(m)) moe->expert_parallel = region;
}

const ParameterSplit& ExpertParallelPlan::split_of(const std::string& name) const {
  return split_or_whole(splits_, name);
}

Tensor ExpertParallelPlan::full_of(const std::string& name, const Tensor& local) const {
  return full_of_split(split_of(name), local, *group_);
}

Tensor ExpertParallelPlan::local_of(const std::string& name, const Tensor& full) const {
  return local_of_split(split_of(name), full, *group_);
}

std::shared_ptr<ExpertParallelPlan> parallelize_experts(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                                        Device device) {
  return std::make_shared<ExpertParallelPlan>(model, std::move(group), device);
}

}  // namespace loom::distributed
