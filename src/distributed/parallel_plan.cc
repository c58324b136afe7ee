// make_plan: the settings, the world size and the model config -> the plan, every impossible layout named at once.
#include "loom/distributed/parallel_plan.h"

#include <sstream>

#include "loom/distributed/pipeline.h"
#include "loom/fp8.h"

namespace loom::distributed {

namespace {

const char* style_name(nn::TensorParallelRule::Style s) {
  switch (s) {
    case nn::TensorParallelRule::Style::kColumnwise: return "columnwise";
    case nn::TensorParallelRule::Style::kRowwise: return "rowwise";
    case nn::TensorParallelRule::Style::kVocabulary: return "vocabulary";
  }
  return "?";
}

template <typename... Args>
std::string words(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// The mesh's shape and what does not fit the world.
MeshShape mesh_shape(int64_t world, const ParallelOptions& o, std::vector<std::string>& problems) {
  MeshShape shape;
  for (auto [flag, n] : {std::pair<const char*, int64_t>{"--tp", o.tensor}, {"--pp", o.pipeline},
                         {"context parallelism", o.context}, {"--ep", o.expert}})
    if (n < 1) problems.push_back(words(flag, " must be at least 1, got ", n));
  if (!problems.empty()) return shape;
  const int64_t model = o.tensor * o.pipeline * o.context;
  if (world % model != 0) {
    problems.push_back(o.context > 1 ? words("--tp ", o.tensor, " x --pp ", o.pipeline, " x context ", o.context,
                                             " does not divide the world of ", world, " ranks")
                                     : words("--tp ", o.tensor, " x --pp ", o.pipeline, " does not divide the world of ",
                                             world, " ranks"));
    return shape;
  }
  shape.tensor = o.tensor;
  shape.pipeline = o.pipeline;
  shape.context = o.context;
  (o.zero_stage > 0 ? shape.data_shard : shape.data_replicate) = world / model;
  shape.expert = o.expert;
  if ((shape.data() * shape.context) % o.expert != 0)
    problems.push_back(words("--ep ", o.expert, " does not divide the ", shape.data() * shape.context,
                             " data-parallel ranks it splits the experts over"));
  return shape;
}

}  // namespace

ParallelPlan make_plan(const nn::ModelConfig& cfg, int64_t world, const ParallelOptions& o) {
  std::vector<std::string> problems;
  ParallelPlan plan;
  plan.mesh = mesh_shape(world, o, problems);
  plan.compute_dtype = o.compute_dtype;
  const nn::ParallelRules rules = nn::parallel_rules(cfg);

  // Tensor (and sequence) parallelism: the family's rules, its sizes divisible by the group.
  if (o.tensor > 1) {
    plan.tensor.rules = rules.tensor;
    for (const auto& d : rules.tensor_divisors)
      if (d.value % o.tensor != 0)
        problems.push_back(words("tensor parallelism: ", d.name, " ", d.value, " does not divide by the tensor-parallel "
                                 "size ", o.tensor, " (", d.why, ")"));
    if (cfg.padded_vocab_size % o.tensor == 0 && (o.tensor - 1) * (cfg.padded_vocab_size / o.tensor) >= cfg.vocab_size)
      problems.push_back(words("tensor parallelism: the last of ", o.tensor, " ranks would hold only padding rows of "
                               "the vocabulary (", cfg.vocab_size, " of ", cfg.padded_vocab_size, "); use fewer "
                               "tensor-parallel ranks"));
  }
  if (o.tensor > 1 && cfg.fp8 != fp8::Scope::kOff)
    problems.push_back(words("--fp8 ", fp8::scope_name(cfg.fp8), " does not run under tensor parallelism (--tp ",
                             o.tensor, ")"));
  plan.tensor.sequence_parallel = o.sequence_parallel;
  if (o.sequence_parallel && o.tensor < 2)
    problems.push_back("--sp splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more");
  if (o.sequence_parallel && o.zero_stage > 1)
    problems.push_back(words("--sp does not combine with --zero ", o.zero_stage, " yet (use --zero 1 or data "
                             "parallelism)"));

  // The data dimensions.
  if (o.zero_stage < 0 || o.zero_stage > 3) problems.push_back(words("--zero must be 0, 1, 2 or 3, got ", o.zero_stage));
  if (o.reduce_dtype != kF32 && o.reduce_dtype != kBF16)
    problems.push_back(words("--reduce-dtype must be f32 or bf16, got ", dtype_name(o.reduce_dtype)));
  plan.data.zero_stage = o.zero_stage;
  plan.data.reduce_dtype = o.reduce_dtype;
  plan.data.gather_dtype = o.zero_stage == 3 ? o.compute_dtype : kF32;
  plan.data.fp8_gathers = o.zero_stage == 3 && (cfg.fp8 == fp8::Scope::kLinear || cfg.fp8 == fp8::Scope::kAll);
  plan.data.bucket_bytes = size_t(o.bucket_mb * double(1 << 20));
  if (o.zero_stage >= 2)
    for (int64_t b = 0; b < cfg.n_layer; ++b) {
      const size_t star = rules.blocks.find('*');
      plan.data.units.push_back(rules.blocks.substr(0, star) + std::to_string(b) +
                                (star == std::string::npos ? "" : rules.blocks.substr(star + 1)));
    }

  // The pipeline: where the stages cut.
  plan.pipeline.schedule = o.pipeline_schedule;
  plan.pipeline.virtual_stages = o.virtual_stages;
  if (o.pipeline > 1) {
    if (o.zero_stage > 1)
      problems.push_back(words("--pp does not combine with --zero ", o.zero_stage, " (use --zero 1 or data "
                               "parallelism)"));
    if (o.pipeline_schedule != "gpipe" && o.pipeline_schedule != "1f1b" && o.pipeline_schedule != "interleaved")
      problems.push_back(words("--pp-schedule must be gpipe, 1f1b or interleaved, got '", o.pipeline_schedule, "'"));
    if (o.virtual_stages < 1 || (o.virtual_stages > 1 && o.pipeline_schedule != "interleaved"))
      problems.push_back(words("--virtual-stages ", o.virtual_stages, " needs --pp-schedule interleaved (got ",
                               o.pipeline_schedule, ")"));
    else if (cfg.n_layer < o.pipeline * o.virtual_stages)
      problems.push_back(words("pipeline: ", cfg.n_layer, " blocks cannot fill ", o.pipeline, " stages x ",
                               o.virtual_stages, " virtual stages (at least one block each)"));
    else
      plan.pipeline.stages = even_stages(cfg.n_layer, o.pipeline * o.virtual_stages);
  }

  // Context and expert parallelism: the room is there; the model family must bring the ops.
  if (o.context > 1 && !rules.attention_splits_sequence)
    problems.push_back(words("context parallelism over ", o.context, " ranks needs an attention that runs over a "
                             "sequence split across ranks; ", cfg.describe(), " has none"));
  if (o.expert > 1 && rules.experts == 0)
    problems.push_back(words("expert parallelism over ", o.expert, " ranks needs a model with experts; ",
                             cfg.describe(), " is dense"));
  if (o.expert > 1 && rules.experts > 0 && rules.experts % o.expert != 0)
    problems.push_back(words("expert parallelism: ", rules.experts, " experts do not divide over ", o.expert, " ranks"));
  else if (o.expert > 1 && rules.experts > 0) {
    plan.expert.parameters = rules.expert_parameters;
    plan.expert.experts = rules.experts;
  }
  // A mixture of experts runs whole on each rank: its experts are not in the tensor-parallel rules, and a pipeline
  // stage would not carry its routers' auxiliary losses to the last stage's loss.
  if (o.tensor > 1 && rules.experts > 0)
    problems.push_back(words("tensor parallelism does not split a mixture of experts (", cfg.describe(),
                             "); use data parallelism or ZeRO"));
  if (o.pipeline > 1 && rules.experts > 0)
    problems.push_back(words("--pp does not carry a mixture of experts' router losses between stages (",
                             cfg.describe(), "); use data parallelism or ZeRO"));

  // LoRA: the adapters train with the data dimensions (replicas, ZeRO-1, and ZeRO-2/3, which shard the adapters
  // alone and leave the frozen base whole on every rank), split with their layers under tensor parallelism (the
  // family's rules) and go with their blocks to pipeline stages.

  plan.recompute = {o.recompute, o.recompute_mlp, o.recompute_blocks};
  if (o.recompute_blocks != -1) {
    if (o.recompute == autograd::Recompute::kNone)
      problems.push_back("--recompute-blocks needs --recompute selective or full");
    else if (o.recompute_blocks < 1 || o.recompute_blocks > cfg.n_layer)
      problems.push_back(words("--recompute-blocks ", o.recompute_blocks, " is not 1..", cfg.n_layer,
                               " (the model's blocks)"));
  }
  if (o.recompute_mlp && (cfg.family != nn::ModelFamily::kGPT2 || cfg.moe.enabled()))
    problems.push_back(words("--recompute-mlp recomputes GPT-2's GELU output, which ", cfg.describe(),
                             " has none (its MLP is SwiGLU); --recompute selective or full recomputes it"));
  if (!problems.empty()) {
    std::string all = "parallelism: " + problems.front();
    for (size_t i = 1; i < problems.size(); ++i) all += "; " + problems[i];
    throw LayoutError(all);
  }
  return plan;
}

bool ParallelPlan::active() const {
  return mesh.world() > 1 || data.zero_stage > 0 || recompute.mode != autograd::Recompute::kNone;
}

std::vector<std::string> ParallelPlan::describe() const {
  std::vector<std::string> lines{mesh.str()};
  if (!tensor.rules.empty()) {  // the rules by style: "columnwise h.*.attn.c_attn.weight, ...; rowwise ..."
    std::ostringstream os;
    os << "tensor " << mesh.tensor << (tensor.sequence_parallel ? ", sequence parallel:" : ":");
    bool any = false;
    for (auto style : {nn::TensorParallelRule::Style::kColumnwise, nn::TensorParallelRule::Style::kRowwise,
                       nn::TensorParallelRule::Style::kVocabulary}) {
      bool first = true;
      for (const auto& r : tensor.rules) {
        if (r.style != style) continue;
        os << (first ? (any ? "; " : " ") + std::string(style_name(style)) + " " : ", ") << r.parameter;
        first = false;
        any = true;
      }
    }
    lines.push_back(os.str());
  }
  if (mesh.data() > 1 || data.zero_stage > 0) {
    static const char* const what[] = {"gradients averaged in buckets of " , "optimizer state sharded",
                                       "optimizer state and gradients sharded",
                                       "optimizer state, gradients and parameters sharded"};
    std::ostringstream os;
    os << "data " << mesh.data() << ": ZeRO stage " << data.zero_stage << ", " << what[data.zero_stage];
    if (data.zero_stage == 0) os << double(data.bucket_bytes) / double(1 << 20) << " MiB";
    if (!data.units.empty()) os << ", " << data.units.size() << " block units + the root";
    if (data.reduce_dtype != kF32) os << ", reduced in " << dtype_name(data.reduce_dtype);
    if (data.gather_dtype != kF32) os << ", matrices gathered in " << dtype_name(data.gather_dtype);
    if (data.fp8_gathers) os << ", FP8 layers' weights gathered as FP8 codes";
    lines.push_back(os.str());
  }
  if (!pipeline.stages.empty()) {
    std::ostringstream os;
    os << "pipeline " << mesh.pipeline << " (" << pipeline.schedule << "):";
    for (size_t v = 0; v < pipeline.stages.size(); ++v)
      os << (v ? " |" : "") << " blocks " << pipeline.stages[v].first << "-" << pipeline.stages[v].second - 1;
    lines.push_back(os.str());
  }
  if (mesh.expert > 1 && !expert.parameters.empty())
    lines.push_back(words("expert ", mesh.expert, ": ", expert.experts / mesh.expert, " of ", expert.experts,
                          " experts per rank and layer, tokens exchanged by all-to-all",
                          mesh.data() * mesh.context == mesh.expert
                              ? std::string("; each expert on one rank")
                              : words("; each expert on ", mesh.data() * mesh.context / mesh.expert,
                                      " ranks, which average its gradients",
                                      data.zero_stage == 1 ? " and shard its optimizer state" : "")));
  if (recompute.mode != autograd::Recompute::kNone || recompute.mlp_hidden)
    lines.push_back(std::string("recompute: ") + autograd::recompute_name(recompute.mode) +
                    (recompute.blocks < 0 ? std::string(" per block") : words(" in blocks 0..", recompute.blocks - 1)) +
                    (recompute.mlp_hidden ? ", the MLPs' GELU output" : ""));
  return lines;
}

void ParallelPlan::check_micro_batches(int64_t micro_batches) const {
  LOOM_REQUIRE(pipeline.virtual_stages == 1 || pipeline.stages.empty() || micro_batches % mesh.pipeline == 0,
               "parallelism: the interleaved schedule needs the micro-batches per step (", micro_batches,
               ") to be a multiple of the pipeline stages (", mesh.pipeline, "); raise --total-batch-tokens");
}

}  // namespace loom::distributed
