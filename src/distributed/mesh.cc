// The device mesh: grid coordinates and the process groups of its dimensions and sub-meshes.
#include "loom/distributed/mesh.h"

#include <sstream>

#include "loom/common/error.h"

namespace loom::distributed {

const char* mesh_dim_name(MeshDim dim) {
  switch (dim) {
    case MeshDim::kPipeline: return "pipeline";
    case MeshDim::kDataReplicate: return "data-replicate";
    case MeshDim::kDataShard: return "data-shard";
    case MeshDim::kContext: return "context";
    case MeshDim::kTensor: return "tensor";
    case MeshDim::kExpert: return "expert";
  }
  return "?";
}

int64_t MeshShape::size(MeshDim dim) const {
  switch (dim) {
    case MeshDim::kPipeline: return pipeline;
    case MeshDim::kDataReplicate: return data_replicate;
    case MeshDim::kDataShard: return data_shard;
    case MeshDim::kContext: return context;
    case MeshDim::kTensor: return tensor;
    case MeshDim::kExpert: return expert;
  }
  return 1;
}

int64_t MeshShape::world() const {
  int64_t n = 1;
  for (MeshDim d : kGridDims) n *= size(d);
  return n;
}

std::string MeshShape::str() const {
  std::ostringstream os;
  os << "world " << world() << " =";
  const char* sep = " ";
  auto dim = [&](const char* name, int64_t n, const char* note = "") {
    if (n == 1) return;
    os << sep << name << " " << n << note;
    sep = " x ";
  };
  dim("pipeline", pipeline);
  dim("data", data(), data_shard > 1 && data_replicate > 1 ? " (replicated x sharded)"
                      : data_shard > 1                    ? " (sharded)"
                                                          : "");
  dim("context", context);
  dim("tensor", tensor);
  if (world() == 1) os << " one rank";
  if (expert > 1) os << ", experts split over " << expert << " of the data ranks";
  return os.str();
}

namespace {

unsigned bit(MeshDim d) { return 1u << unsigned(d); }

}  // namespace

Mesh::Mesh(std::shared_ptr<ProcessGroup> world, MeshShape shape) : world_(std::move(world)), shape_(shape) {
  LOOM_REQUIRE(world_, "mesh: no world group");
  LOOM_REQUIRE(shape_.world() == world_->size(), "mesh: ", shape_.str(), " does not fit a world of ", world_->size(),
               " ranks");
  // Coordinates: the rank as a mixed-radix number over the grid, the last dimension fastest.
  int64_t r = world_->rank();
  for (size_t i = kGridDims.size(); i-- > 0;) {
    const int64_t n = shape_.size(kGridDims[i]);
    coords_[i] = r % n;
    r /= n;
  }
  // Every group now, in one order on every rank (creating one is collective).
  const unsigned data = bit(MeshDim::kDataReplicate) | bit(MeshDim::kDataShard);
  dims_[MeshDim::kTensor] = span(bit(MeshDim::kTensor));
  data_ = span(data);
  dims_[MeshDim::kPipeline] = span(bit(MeshDim::kPipeline));
  model_ = span(bit(MeshDim::kPipeline) | bit(MeshDim::kTensor));
  dims_[MeshDim::kDataReplicate] = span(bit(MeshDim::kDataReplicate));
  dims_[MeshDim::kDataShard] = span(bit(MeshDim::kDataShard));
  dims_[MeshDim::kContext] = span(bit(MeshDim::kContext));
  // Experts: consecutive runs of `expert` ranks of the data x context group; the ranks at the same place in every
  // run hold the same experts.
  const unsigned borrowed_dims = data | bit(MeshDim::kContext);
  const int64_t borrowed = shape_.data() * shape_.context;
  LOOM_REQUIRE(shape_.expert >= 1 && borrowed % shape_.expert == 0, "mesh: experts over ", shape_.expert,
               " ranks do not divide the ", borrowed, " data x context ranks");
  if (shape_.expert == 1) {
    dims_[MeshDim::kExpert] = make_single_process_group();
    expert_replicas_ = span(borrowed_dims);
  } else if (shape_.expert == borrowed) {
    dims_[MeshDim::kExpert] = span(borrowed_dims);
    expert_replicas_ = make_single_process_group();
  } else {
    const int64_t within = (coords_[size_t(MeshDim::kDataReplicate)] * shape_.data_shard +
                            coords_[size_t(MeshDim::kDataShard)]) * shape_.context +
                           coords_[size_t(MeshDim::kContext)];
    int64_t outside = 0;
    for (size_t i = 0; i < kGridDims.size(); ++i)
      if (!(borrowed_dims & bit(kGridDims[i]))) outside = outside * shape_.size(kGridDims[i]) + coords_[i];
    dims_[MeshDim::kExpert] =
        world_->split(int(outside * (borrowed / shape_.expert) + within / shape_.expert), world_->rank());
    expert_replicas_ = world_->split(int(outside * shape_.expert + within % shape_.expert), world_->rank());
  }
}

std::shared_ptr<ProcessGroup> Mesh::span(unsigned dims) {
  unsigned effective = 0, every = 0;  // only dimensions of more than one rank change the group
  for (MeshDim d : kGridDims) {
    if (shape_.size(d) == 1) continue;
    every |= bit(d);
    if (dims & bit(d)) effective |= bit(d);
  }
  if (effective == 0) return make_single_process_group();
  if (effective == every) return world_;
  auto it = spans_.find(effective);
  if (it != spans_.end()) return it->second;
  int64_t color = 0;  // the coordinates outside the span, as one number
  for (size_t i = 0; i < kGridDims.size(); ++i)
    if (!(effective & bit(kGridDims[i]))) color = color * shape_.size(kGridDims[i]) + coords_[i];
  return spans_[effective] = world_->split(int(color), world_->rank());
}

int64_t Mesh::coordinate(MeshDim dim) const {
  if (dim == MeshDim::kExpert) return group(dim)->rank();
  for (size_t i = 0; i < kGridDims.size(); ++i)
    if (kGridDims[i] == dim) return coords_[i];
  return 0;
}

const std::shared_ptr<ProcessGroup>& Mesh::group(MeshDim dim) const { return dims_.at(dim); }

}  // namespace loom::distributed
