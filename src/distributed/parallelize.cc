// parallelize: the plan applied dimension by dimension to the one model, and the ParallelModel the trainer's road
// goes through.
#include "loom/distributed/parallelize.h"

#include <map>

#include "distributed/parallel_parts.h"
#include "loom/autograd/grad_mode.h"

namespace loom::distributed {

struct ParallelModel::Impl {
  std::shared_ptr<nn::LanguageModel> model;
  std::shared_ptr<const Mesh> mesh;
  ParallelPlan plan;
  Device device;
  // The modes the plan applied (null where a dimension has one rank or the plan does not use it).
  std::shared_ptr<TensorParallelPlan> tensor;
  std::unique_ptr<PipelineParallel> pipeline;
  std::unique_ptr<FullyShardedDataParallel> shards;
  std::unique_ptr<DistributedDataParallel> replicas;
  std::shared_ptr<ExpertParallelPlan> expert;
  std::unique_ptr<DistributedDataParallel> expert_replicas;  // the expert weights' replicas, when there are several
  // What the road sees.
  std::unique_ptr<Schedule> schedule;
  std::unique_ptr<GradientSync> gradients;
  std::unique_ptr<PlanOptimizer> optimizer;
  Ownership ownership;
};

namespace {

// Per parameter the optimizer updates: its weight in the global gradient norm (a parameter the tensor dimension
// replicates counts once per group, a tied embedding held by the first and the last stage once).
std::map<const TensorImpl*, double> norm_weights(const ParallelModel::Impl& m) {
  std::map<const TensorImpl*, double> weight_of;
  auto named = m.model->named_parameters();
  const std::vector<double> tensor = m.tensor ? m.tensor->norm_weights() : std::vector<double>();
  for (size_t i = 0; i < named.size(); ++i) weight_of[&named[i].second.impl()] = m.tensor ? tensor[i] : 1.0;
  if (m.pipeline) {
    auto local = m.pipeline->local_named_parameters();
    auto w = m.pipeline->norm_weights();
    for (size_t i = 0; i < local.size(); ++i) weight_of[&local[i].second.impl()] *= w[i];
  }
  return weight_of;
}

std::string own_name(const Ownership& own, const Tensor& p) {
  for (auto& [name, q] : own.model->named_parameters())
    if (q.is_same(p)) return name;
  return "";
}

// Under expert parallelism each rank's experts got the gradients of every rank's tokens routed to them (the exchanges'
// backward): summed over the expert group where the other parameters' are averaged over the data ranks. The replicas
// of the same experts average theirs (expert_replicas); dividing by the expert ranks makes that the mean over every
// data rank.
std::vector<Tensor> expert_gradients(const ParallelModel::Impl& m) {
  std::vector<Tensor> out;
  if (!m.expert) return out;
  for (auto& [name, p] : m.model->named_parameters())
    if (m.expert->is_expert(name)) out.push_back(p);
  return out;
}

// AdamW's groups over what this rank trains. Under expert parallelism the expert weights form a group of their own,
// last: their gradient slots then follow every other parameter's in the flat buffer, so that no all-reduce over a
// range of the other parameters' slots (DDP's flat buckets, over every data rank) takes an expert's gradient along.
std::vector<optim::ParamGroup> param_groups(const ParallelModel::Impl& m, double weight_decay) {
  std::vector<optim::ParamGroup> groups = optim::adamw_param_groups(m.ownership.trained_parameters(), weight_decay);
  if (!m.expert) return groups;
  optim::ParamGroup experts{{}, weight_decay};
  for (optim::ParamGroup& g : groups) {
    std::vector<Tensor> rest;
    for (Tensor& p : g.params) (m.expert->is_expert(own_name(m.ownership, p)) ? experts.params : rest).push_back(p);
    g.params = std::move(rest);
  }
  groups.push_back(std::move(experts));
  return groups;
}

}  // namespace

std::unique_ptr<ParallelModel> parallelize(std::shared_ptr<nn::LanguageModel> model, std::shared_ptr<const Mesh> mesh,
                                           const ParallelPlan& plan, Device device, const optim::AdamWOptions& adamw,
                                           double weight_decay) {
  LOOM_REQUIRE(model && mesh, "parallelize: no model or no mesh");
  LOOM_REQUIRE(mesh->shape().world() == plan.mesh.world() && mesh->shape().tensor == plan.mesh.tensor &&
                   mesh->shape().pipeline == plan.mesh.pipeline && mesh->shape().expert == plan.mesh.expert,
               "parallelize: the plan is for ", plan.mesh.str(), ", the mesh is ", mesh->str());
  auto m = std::make_unique<ParallelModel::Impl>();
  m->model = model;
  m->mesh = mesh;
  m->plan = plan;
  m->device = device;
  model->set_recompute(plan.recompute.mode, plan.recompute.mlp_hidden, plan.recompute.blocks);
  // Tensor: the layers split in place by the family's rules; this rank keeps its pieces of the full model.
  if (plan.mesh.tensor > 1)
    m->tensor = parallelize_tensor(*model, mesh->group(MeshDim::kTensor), plan.tensor.sequence_parallel);
  // Pipeline: this stage keeps its blocks (before the move: the rest is never copied over).
  if (plan.mesh.pipeline > 1) {
    PipelineOptions po;
    po.schedule = plan.pipeline.schedule;
    po.virtual_stages = int(plan.pipeline.virtual_stages);
    po.stages = plan.pipeline.stages;
    m->pipeline = std::make_unique<PipelineParallel>(*model, mesh->group(MeshDim::kPipeline), po);
  }
  // Experts: each MoE layer keeps this rank's experts and exchanges tokens with the rest of its expert group.
  if (plan.mesh.expert > 1) m->expert = parallelize_experts(*model, mesh->group(MeshDim::kExpert), device);
  // Context: at one rank (make_plan refuses more until a model family brings its ops) it leaves the model as it is.
  model->to(device);

  Ownership& own = m->ownership;
  own.model = model.get();
  own.tensor = m->tensor.get();
  own.pipeline = m->pipeline.get();
  own.tensor_rank = mesh->coordinate(MeshDim::kTensor);
  own.tensor_size = plan.mesh.tensor;
  own.data_rank = mesh->data()->rank();
  own.data_size = mesh->data()->size();
  own.expert = m->expert.get();
  own.expert_rank = mesh->coordinate(MeshDim::kExpert);
  own.replica_rank = mesh->expert_replicas()->rank();
  own.replica_size = mesh->expert_replicas()->size();
  const auto named = model->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) own.index_of[named[i].first] = i;

  // Data: ZeRO-2/3 shard the units and AdamW updates the shards; else AdamW over what this rank trains, ZeRO-1
  // sharding its state, or replicas averaging their gradients in buckets.
  optim::AdamWOptions ao = adamw;
  const bool model_parallel = m->tensor || m->pipeline;
  const std::map<const TensorImpl*, double> weight_of = norm_weights(*m);
  if (plan.data.zero_stage >= 2) {
    FSDPOptions fo;
    fo.stage = int(plan.data.zero_stage);
    fo.param_dtype = plan.data.gather_dtype;
    fo.fp8_gathers = plan.data.fp8_gathers;
    fo.reduce_dtype = plan.data.reduce_dtype;
    if (m->expert) {  // this rank's experts sharded over their replicas, the rest over every data rank
      fo.is_expert = [expert = m->expert](const std::string& name) { return expert->is_expert(name); };
      fo.expert_replicas = mesh->expert_replicas();
      fo.expert_ranks = plan.mesh.expert;
    }
    m->shards = std::make_unique<FullyShardedDataParallel>(*model, mesh->data(), fo);
    auto opt = std::make_unique<optim::AdamW>(m->shards->param_groups(weight_decay), ao);
    if (model_parallel) {
      std::vector<double> per_named;
      for (auto& [name, p] : named) per_named.push_back(weight_of.at(&p.impl()));
      m->shards->set_norm_weights(per_named, mesh->world());
    }
    m->optimizer = make_sharded_adamw(std::move(opt), *m->shards);
  } else {
    auto opt = std::make_unique<optim::AdamW>(param_groups(*m, weight_decay), ao);
    std::vector<double> weights;
    if (model_parallel)
      for (const Tensor& p : opt->parameters()) weights.push_back(weight_of.at(&p.impl()));
    if (plan.data.zero_stage == 1 && m->expert && !param_groups(*m, weight_decay).back().params.empty()) {
      // The expert weights' state sharded over the replicas of this rank's experts (each keeps its experts' whole
      // with one replica), the rest over every data rank. The experts' gradients, summed over the expert group and
      // divided by its ranks (the gradient sync), are averaged over the replicas: the mean over every data rank.
      LOOM_REQUIRE(!model_parallel, "parallelize: expert parallelism with ZeRO-1 takes no tensor or pipeline split");
      std::vector<optim::ParamGroup> groups = param_groups(*m, weight_decay);
      std::vector<optim::ParamGroup> experts{groups.back()};
      groups.pop_back();
      auto zero = std::make_unique<ZeroAdamW>(std::move(groups), ao, mesh->data());
      auto expert_zero = std::make_unique<ZeroAdamW>(std::move(experts), ao, mesh->expert_replicas());
      m->optimizer = make_zero1_adamw(std::move(opt), std::move(zero), std::move(expert_zero), mesh->world());
    } else if (plan.data.zero_stage == 1) {
      auto zero = std::make_unique<ZeroAdamW>(optim::adamw_param_groups(own.trained_parameters(), weight_decay), ao,
                                              mesh->data());
      if (model_parallel) zero->set_norm_reduction(weights, mesh->world());
      m->optimizer = make_zero1_adamw(std::move(opt), std::move(zero));
    } else {
      if (mesh->data()->size() > 1) {
        DDPOptions ddp;
        ddp.reduce_dtype = plan.data.reduce_dtype;
        ddp.bucket_bytes = plan.data.bucket_bytes;
        // Under expert parallelism the experts' gradients go over the replicas of the same experts only.
        std::vector<Tensor> whole, experts;
        for (const Tensor& p : parameters_for_ddp(*opt))
          (m->expert && m->expert->is_expert(own_name(own, p)) ? experts : whole).push_back(p);
        m->replicas = std::make_unique<DistributedDataParallel>(whole, mesh->data(), ddp);
        m->replicas->broadcast_parameters(0);
        if (!experts.empty() && mesh->expert_replicas()->size() > 1) {
          m->expert_replicas = std::make_unique<DistributedDataParallel>(experts, mesh->expert_replicas(), ddp);
          m->expert_replicas->broadcast_parameters(0);
        }
      }
      if (m->expert) {
        // The norm over the expert group: each rank's experts once, the rest replicated over it.
        weights.clear();
        for (const Tensor& p : opt->parameters())
          weights.push_back(m->expert->is_expert(own_name(own, p)) ? 1.0 : 1.0 / double(plan.mesh.expert));
        m->optimizer = make_adamw(std::move(opt), std::move(weights), mesh->group(MeshDim::kExpert), true);
      } else {
        // Under model parallelism each rank holds the state of its own pieces.
        m->optimizer = make_adamw(std::move(opt), std::move(weights), model_parallel ? mesh->model() : nullptr,
                                  model_parallel);
      }
    }
  }
  // ZeRO-2/3 divide the experts' gradients themselves, as they reduce them.
  m->gradients = make_gradient_sync(m->replicas.get(), m->shards.get(), m->tensor.get(), m->expert_replicas.get(),
                                    m->shards ? std::vector<Tensor>() : expert_gradients(*m),
                                    m->shards ? 1 : plan.mesh.expert);
  m->schedule = m->pipeline ? make_pipeline_schedule(*m->pipeline, *model, plan.compute_dtype, device)
                            : make_micro_batch_schedule(*model, plan.compute_dtype,
                                                        m->tensor || m->shards || m->expert);
  return std::make_unique<ParallelModel>(std::move(m));
}

ParallelModel::ParallelModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParallelModel::~ParallelModel() = default;

nn::LanguageModel& ParallelModel::model() const { return *impl_->model; }
Device ParallelModel::device() const { return impl_->device; }
const Mesh& ParallelModel::mesh() const { return *impl_->mesh; }
const ParallelPlan& ParallelModel::plan() const { return impl_->plan; }
Schedule& ParallelModel::schedule() { return *impl_->schedule; }
GradientSync& ParallelModel::gradients() { return *impl_->gradients; }
TrainingOptimizer& ParallelModel::optimizer() { return *impl_->optimizer; }

std::vector<std::string> ParallelModel::describe() const {
  std::vector<std::string> lines = impl_->plan.describe();
  if (impl_->pipeline) lines.push_back(impl_->pipeline->describe());
  return lines;
}

std::vector<std::pair<std::string, Tensor>> ParallelModel::full_parameters() const {
  const Impl& m = *impl_;
  std::vector<std::pair<std::string, Tensor>> local = m.shards     ? m.shards->full_named_parameters()
                                                      : m.pipeline ? m.pipeline->full_named_parameters()
                                                                   : m.model->named_parameters();
  if (m.expert)
    for (auto& [name, t] : local) t = m.expert->full_of(name, t);
  if (!m.tensor) return local;
  for (auto& [name, t] : local) t = m.tensor->full_of(name, t);
  return local;
}

void ParallelModel::load_full_parameters(const std::vector<std::pair<std::string, Tensor>>& full) {
  Impl& m = *impl_;
  autograd::NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> local = full;
  if (m.tensor)
    for (auto& [name, t] : local) t = m.tensor->local_of(name, t);
  if (m.expert)
    for (auto& [name, t] : local) t = m.expert->local_of(name, t);
  if (m.shards) {
    m.shards->load_full_named_parameters(local);
    return;
  }
  if (m.pipeline) {
    m.pipeline->load_full_named_parameters(local);
    return;
  }
  std::map<std::string, Tensor> by_name(local.begin(), local.end());
  for (auto& [name, p] : m.model->named_parameters()) p.copy_from(by_name.at(name));
}

optim::OptimizerState ParallelModel::optimizer_state() const { return impl_->optimizer->state(); }
void ParallelModel::load_optimizer_state(const optim::OptimizerState& state) { impl_->optimizer->load_state(state); }
bool ParallelModel::optimizer_state_per_rank() const { return impl_->optimizer->state_per_rank(); }

ParameterSplit ParallelModel::tensor_split(const std::string& name) const {
  if (impl_->expert && impl_->expert->is_expert(name)) return impl_->expert->split_of(name);
  return impl_->tensor ? impl_->tensor->split_of(name) : ParameterSplit{};
}

int64_t ParallelModel::split_parts(const std::string& name) const {
  if (impl_->expert && impl_->expert->is_expert(name)) return impl_->plan.mesh.expert;
  return impl_->plan.mesh.tensor;
}

int64_t ParallelModel::split_part(const std::string& name) const {
  if (impl_->expert && impl_->expert->is_expert(name)) return impl_->mesh->coordinate(MeshDim::kExpert);
  return impl_->mesh->coordinate(MeshDim::kTensor);
}

std::vector<StatePiece> ParallelModel::state_pieces() const {
  autograd::NoGradGuard ng;
  return impl_->optimizer->pieces(impl_->ownership);
}

std::map<std::string, int64_t> ParallelModel::adam_steps() const {
  return impl_->optimizer->adam_steps(impl_->ownership);
}

void ParallelModel::load_state_pieces(const PieceReader& read, int64_t optimizer_step, double lr,
                                      const std::function<int64_t(const std::string&)>& saved_adam_step) {
  autograd::NoGradGuard ng;
  impl_->optimizer->load_pieces(impl_->ownership, read, optimizer_step, lr, saved_adam_step);
}

}  // namespace loom::distributed
