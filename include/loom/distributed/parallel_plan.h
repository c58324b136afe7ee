// The parallel plan: what parallelize (loom/distributed/parallelize.h) does to the one model definition, as data.
// make_plan builds it from the settings, the world size and the model config alone, and checks it: every layout that
// cannot be (sizes that do not divide the world, tensor parallelism wider than the heads, a combination not built)
// is one error before anything is allocated.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loom/autograd/checkpoint.h"
#include "loom/common/dtype.h"
#include "loom/distributed/mesh.h"
#include "loom/nn/model.h"

namespace loom::distributed {

// What a run asks for (loom-train's [parallelism] settings; errors name their flags).
struct ParallelOptions {
  int64_t tensor = 1;    // --tp: ranks that split each layer
  int64_t pipeline = 1;  // --pp: stages
  int64_t context = 1;   // ranks that split each sequence (a model family whose attention can split it comes first)
  int64_t expert = 1;    // ranks that split the experts (a model family with experts comes first)
  int64_t zero_stage = 0;  // --zero: what the data-parallel ranks shard (0: nothing, DDP)
  bool sequence_parallel = false;  // --sp
  std::string pipeline_schedule = "1f1b";  // --pp-schedule: gpipe, 1f1b or interleaved
  int64_t virtual_stages = 1;
  autograd::Recompute recompute = autograd::Recompute::kNone;
  bool recompute_mlp = false;  // GPT-2: the MLPs' GELU output recomputed in the backward
  int64_t recompute_blocks = -1;  // --recompute-blocks: only blocks 0..n-1 recompute (-1: every block)
  DType reduce_dtype = kF32;   // gradients averaged (DDP) or reduce-scattered (ZeRO-2/3) in f32 or bf16
  double bucket_mb = 25;       // DDP: gradient MiB per all-reduce
  DType compute_dtype = kF32;  // autocast's: ZeRO-3 gathers the blocks' matrices in it
};

// Each dimension's part of the plan.
struct TensorPlan {  // the tensor dimension: the model family's rules (empty with one tensor rank)
  std::vector<nn::TensorParallelRule> rules;
  bool sequence_parallel = false;
};
struct DataPlan {  // the data dimensions
  int64_t zero_stage = 0;  // 0: replicas average gradients in buckets; 1: optimizer state sharded; 2: + gradients;
                           // 3: + parameters (gathered unit by unit)
  std::vector<std::string> units;  // ZeRO-2/3: the modules wrapped as units of their own (each block); the rest is
                                   // one root unit
  DType gather_dtype = kF32;       // ZeRO-3: the blocks' matrices
  bool fp8_gathers = false;        // ZeRO-3: the blocks' FP8 layers' weights gathered as their FP8 codes
  DType reduce_dtype = kF32;
  size_t bucket_bytes = size_t(25) << 20;
};
struct PipelinePlan {  // the pipeline dimension
  std::string schedule = "1f1b";
  int64_t virtual_stages = 1;
  std::vector<std::pair<int64_t, int64_t>> stages;  // per virtual stage (stage s's chunk c is c x P + s): blocks
};
struct ExpertPlan {  // the expert dimension (empty with one expert rank)
  std::vector<std::string> parameters;  // the experts' stacked weights, "*" standing for the block index; dim 0 splits
  int64_t experts = 0;                  // per MoE layer, over every rank (mesh.expert ranks hold experts / mesh.expert)
};
struct RecomputePlan {
  autograd::Recompute mode = autograd::Recompute::kNone;  // per block
  bool mlp_hidden = false;
  int64_t blocks = -1;  // the first `blocks` blocks recompute, the rest keep their activations (-1: every block)
};

struct ParallelPlan {
  MeshShape mesh;
  DType compute_dtype = kF32;  // the matrix math's (autocast): every schedule runs its forwards and backwards in it
  TensorPlan tensor;
  DataPlan data;
  PipelinePlan pipeline;
  RecomputePlan recompute;
  ExpertPlan expert;
  // The context dimension holds no plan of its own yet: at size 1 it leaves the model as it is.

  // The mesh, then one line per dimension that does something ("tensor 2, sequence parallel: columnwise
  // h.*.attn.c_attn.weight, ...; rowwise ...", "data 2: ZeRO stage 1, optimizer state sharded", ...).
  std::vector<std::string> describe() const;
  // Whether the plan changes anything at all (a world of one rank training plainly does not).
  bool active() const;
  // The micro-batches of a step fill the schedule (interleaving needs a multiple of the stages); throws naming both.
  void check_micro_batches(int64_t micro_batches) const;
};

// A layout refused from the flags alone: every rank of a launch raises the same one, so the apps say it once (rank 0).
class LayoutError : public Error {
 public:
  using Error::Error;
};

// The plan of `options` for a world of `world` ranks and a model of config `cfg`: the mesh's shape (tensor, pipeline,
// context as given; the rest data-parallel, sharded when zero_stage > 0), the family's tensor-parallel rules, the
// stages' blocks, the wrapped units. Every problem found is named in one LayoutError (one line).
ParallelPlan make_plan(const nn::ModelConfig& cfg, int64_t world, const ParallelOptions& options);

}  // namespace loom::distributed
