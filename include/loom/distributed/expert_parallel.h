// Expert parallelism: a mixture of experts' experts split across the ranks of an expert group (each holds
// num_experts / ranks of every MoE layer's experts, the rest of the model whole), tokens exchanged with the ranks
// that hold their experts by a variable-size all-to-all (ProcessGroup::all_to_all) and back. The one Mixtral
// definition runs split through nn::ExpertParallelRegion; nn knows nothing of process groups.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/distributed/process_group.h"
#include "loom/distributed/tensor_parallel.h"
#include "loom/nn/model.h"

namespace loom::distributed {

// Rows of x exchanged over `group`: send_rows[r] rows (x's, in order) to rank r, recv_rows[r] rows from rank r, in
// rank order -> [sum(recv_rows), C]. Differentiable: the backward sends the gradient's rows back.
Tensor exchange_rows(const Tensor& x, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                     const std::shared_ptr<ProcessGroup>& group);

// The plan over the one model definition: parallelize_experts cuts the family's stacked expert weights
// (nn::ParallelRules::expert_parameters) to this rank's experts, in place, and hands each MoE layer a region over
// `group`.
class ExpertParallelPlan {
 public:
  // `device`: where the model will compute (the routing counts are exchanged there).
  ExpertParallelPlan(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group, Device device);
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  // Whether `name` is an expert weight (split along dim 0 over the group).
  bool is_expert(const std::string& name) const { return splits_.count(name) > 0; }
  const ParameterSplit& split_of(const std::string& name) const;
  // One parameter's full value from this rank's experts (gathered; collective), and this rank's experts of a full
  // value. Other parameters pass through.
  Tensor full_of(const std::string& name, const Tensor& local) const;
  Tensor local_of(const std::string& name, const Tensor& full) const;

 private:
  nn::LanguageModel& model_;
  std::shared_ptr<ProcessGroup> group_;
  std::map<std::string, ParameterSplit> splits_;
};

std::shared_ptr<ExpertParallelPlan> parallelize_experts(nn::LanguageModel& model, std::shared_ptr<ProcessGroup> group,
                                                        Device device);

}  // namespace loom::distributed
