// The device mesh: the world's ranks as a grid of named dimensions, with the process group of each dimension and of
// the sub-meshes the parallel plan needs (docs/DISTRIBUTED.md, "The mesh, the plan and the road"). Built once, from
// the world and a MeshShape that make_plan (loom/distributed/parallel_plan.h) has checked.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "loom/distributed/process_group.h"

namespace loom::distributed {

// The dimensions of the mesh. The first five form the grid: a rank's number is its coordinates read as one
// mixed-radix number, outermost first, so the tensor dimension's groups are adjacent ranks (one node's NVLink). The
// expert dimension is not in the grid: it borrows its ranks from data x context, where experts would otherwise be
// replicated or sharded (as torchtitan's ParallelDims has it): runs of `expert` consecutive ranks of that group.
enum class MeshDim { kPipeline, kDataReplicate, kDataShard, kContext, kTensor, kExpert };
inline constexpr std::array<MeshDim, 5> kGridDims{MeshDim::kPipeline, MeshDim::kDataReplicate, MeshDim::kDataShard,
                                                  MeshDim::kContext, MeshDim::kTensor};
const char* mesh_dim_name(MeshDim dim);  // "pipeline", "data-replicate", "data-shard", "context", "tensor", "expert"

struct MeshShape {
  int64_t pipeline = 1;
  int64_t data_replicate = 1;  // replicas that average their gradients (DDP)
  int64_t data_shard = 1;      // ranks that shard optimizer state, gradients or parameters between them (ZeRO)
  int64_t context = 1;         // ranks that split each sequence
  int64_t tensor = 1;          // ranks that split each layer
  int64_t expert = 1;          // ranks that split the experts (borrowed from data x context)

  int64_t size(MeshDim dim) const;
  int64_t world() const;  // the grid's ranks
  int64_t data() const { return data_replicate * data_shard; }  // ranks that read batches of their own
  // "world 8 = pipeline 2 x data 2 (sharded) x tensor 2"; dimensions of size 1 are left out.
  std::string str() const;
};

class Mesh {
 public:
  // Splits `world` (of shape.world() ranks) into the groups of every dimension and sub-mesh. Collective over
  // `world`: every rank builds the same groups in the same order. A group of one rank is a single-process group (no
  // communicator); a group that spans every rank is `world` itself.
  Mesh(std::shared_ptr<ProcessGroup> world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  const std::shared_ptr<ProcessGroup>& world() const { return world_; }
  // This rank's coordinate along `dim`, and the group of the ranks that differ from it only there.
  int64_t coordinate(MeshDim dim) const;
  const std::shared_ptr<ProcessGroup>& group(MeshDim dim) const;
  // Sub-meshes. data(): data-replicate x data-shard, the ranks that read batches of their own (the loader's rank and
  // count, the mean of the loss); model(): pipeline x tensor, one replica's pieces of the model (a gradient norm over
  // parameters that model parallelism splits).
  const std::shared_ptr<ProcessGroup>& data() const { return data_; }
  const std::shared_ptr<ProcessGroup>& model() const { return model_; }
  // The ranks that hold the same experts as this one under expert parallelism: the data x context ranks of the same
  // expert coordinate (one per expert group). Their expert gradients are reduced together; the rest go over data().
  const std::shared_ptr<ProcessGroup>& expert_replicas() const { return expert_replicas_; }
  std::string str() const { return shape_.str(); }

 private:
  // The group of the ranks whose coordinates agree outside `dims` (a bit per grid dimension).
  std::shared_ptr<ProcessGroup> span(unsigned dims);

  std::shared_ptr<ProcessGroup> world_;
  MeshShape shape_;
  std::array<int64_t, kGridDims.size()> coords_{};
  std::map<unsigned, std::shared_ptr<ProcessGroup>> spans_;  // by the dims of size > 1 they span
  std::map<MeshDim, std::shared_ptr<ProcessGroup>> dims_;
  std::shared_ptr<ProcessGroup> data_, model_, expert_replicas_;
};

}  // namespace loom::distributed
