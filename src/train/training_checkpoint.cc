// Saving and resuming a parallel model's training state: single files and sharded directories
// (loom/train/training_checkpoint.h). The plan's optimizer says which pieces this rank holds; this file writes and
// reads them.
#include "loom/train/training_checkpoint.h"

#include <filesystem>
#include <iostream>
#include <map>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "io/json_numbers.h"
#include "loom/autograd/grad_mode.h"
#include "loom/distributed/parallelize.h"
#include "loom/fp8.h"
#include "loom/io/atomic_file.h"
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "loom/train/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

// Beside a single-file checkpoint: the optimizer state of one rank, where it differs between ranks.
std::string optimizer_shard_path(const std::string& checkpoint, int rank) {
  fs::path p = checkpoint;
  return (p.parent_path() / (p.stem().string() + ".optim-rank" + std::to_string(rank) + ".safetensors")).string();
}

TpSplit split_of(const distributed::ParallelModel& parallel, const std::string& name) {
  const distributed::ParameterSplit s = parallel.tensor_split(name);
  return TpSplit{s.sharded, s.dim, s.blocks, parallel.split_parts(name)};
}

Shape full_shape_of(const Shape& local, const TpSplit& split) {
  Shape full = local;
  if (split.sharded && split.ranks > 1) {
    int64_t total = 0;
    for (int64_t b : split.blocks) total += b;
    full[size_t(split.dim)] = total;
  }
  return full;
}

// This rank's FP8 scaling states worth carrying (delayed scaling's, once started), as "fp8.<layer>.<operand>".
io::TensorMap fp8_states(const distributed::ParallelModel& parallel) {
  io::TensorMap out;
  for (auto& [name, scaling] : parallel.model().fp8_scalings())
    if (Tensor t = scaling->saved_state(); t.defined()) out["fp8." + name] = t;
  return out;
}

// Restores this rank's delayed FP8 scaling from `saved` (a rank file's "fp8.*" tensors; nothing when the checkpoint
// was saved by another layout, whose ranks measured other rows), every state checked before the first changes. What
// it cannot carry over goes into `notes`.
void restore_fp8_states(distributed::ParallelModel& parallel, const io::TensorMap& saved, bool same_layout,
                        const std::string& path, std::vector<std::string>& notes) {
  std::vector<std::pair<std::string, fp8::TensorScaling*>> delayed;
  for (auto& [name, scaling] : parallel.model().fp8_scalings())
    if (scaling->history_length() > 1) delayed.emplace_back(name, scaling);
  if (delayed.empty()) return;  // current scaling (or none): nothing outlives a step
  const std::string afresh = "; each FP8 operand's scale starts from its own amax, as at a run's first step";
  if (!same_layout) {
    notes.push_back("resume: '" + path + "' was saved by another layout, whose ranks measured other amaxes" + afresh);
    return;
  }
  std::vector<std::pair<fp8::TensorScaling*, const Tensor*>> found;
  int64_t saved_length = 0;
  for (auto& [name, scaling] : delayed) {
    auto it = saved.find("fp8." + name);
    if (it == saved.end()) continue;  // a layer that had not run when it was saved (a pipeline stage's stand-in)
    fp8::TensorScaling::check_saved_state(it->second, "resume: '" + path + "': fp8." + name);
    saved_length = it->second.numel() - 4;
    found.emplace_back(scaling, &it->second);
  }
  if (found.empty()) {
    notes.push_back("resume: '" + path + "' holds no FP8 scaling state (saved by a run without delayed scaling, or "
                    "by an older Loom)" + afresh);
    return;
  }
  const int64_t length = delayed.front().second->history_length();
  if (saved_length != length)
    notes.push_back("resume: the FP8 amax histories of " + std::to_string(saved_length) + " steps in '" + path +
                    "' are taken into " + std::to_string(length) + " (newest first" +
                    (length > saved_length ? ", the older ones empty)" : ")"));
  for (auto& [scaling, state] : found) scaling->restore_state(*state, parallel.device(), "resume: '" + path + "'");
}

io::TensorMap with_prefix(const io::TensorMap& tensors, const std::string& prefix) {
  io::TensorMap out;
  for (auto& [name, t] : tensors)
    if (name.rfind(prefix, 0) == 0) out[name] = t;
  return out;
}

void point_latest_at(const fs::path& checkpoint, const std::string& checkpoint_dir) {
  if (!checkpoint_dir.empty() && checkpoint.parent_path() == fs::path(checkpoint_dir))
    io::write_file_atomic((fs::path(checkpoint_dir) / "latest").string(), checkpoint.filename().string() + "\n");
}

// One file: the whole model gathered onto rank 0, the optimizer state beside it per rank where it differs.
void save_single(distributed::ParallelModel& parallel, const CheckpointSave& save) {
  const int rank = parallel.mesh().world()->rank();
  const fs::path dir = fs::path(save.path).parent_path();
  if (!dir.empty()) fs::create_directories(dir);
  io::TensorMap tensors;
  for (auto& [name, p] : parallel.full_parameters()) tensors["model." + name] = p.detach().to(Device());  // collective
  const optim::OptimizerState state = parallel.optimizer_state();
  // What differs between ranks goes into the rank's own file: the optimizer state where it is sharded, and in a
  // distributed run the FP8 scaling state (each rank measures its own rows).
  const io::TensorMap fp8 = fp8_states(parallel);
  const bool one_process = parallel.mesh().world()->size() == 1;
  const std::string shard_path = optimizer_shard_path(save.path, rank);
  if (parallel.optimizer_state_per_rank() || (!one_process && !fp8.empty())) {
    io::TensorMap shard = one_process ? io::TensorMap{} : fp8;
    io::TensorMap& optim = parallel.optimizer_state_per_rank() ? shard : tensors;
    for (auto& [name, t] : state) optim["optim." + name] = t.to(Device());
    io::save_safetensors(shard_path, shard, {{"format", "loom-optimizer-shard-1"}});
  } else {
    for (auto& [name, t] : state) tensors["optim." + name] = t.to(Device());
    std::error_code ec;  // an overwritten checkpoint's rank file would otherwise be read with this one
    fs::remove(shard_path, ec);
  }
  if (one_process) tensors.insert(fp8.begin(), fp8.end());
  if (rank != 0) return;
  io::save_safetensors(save.path, tensors,
                       {{"format", kCheckpointFormat}, {"state", save.state_json},
                        {"config", parallel.model().config().to_json()}});
  point_latest_at(save.path, save.checkpoint_dir);
  if (!save.quiet) std::cout << "saved checkpoint " << save.path << std::endl;
}

std::string rank_file(int64_t r) {
  char name[32];
  std::snprintf(name, sizeof name, "rank%05ld.safetensors", long(r));
  return name;
}

// A directory: every rank writes its pieces in parallel, rank 0 the meta.json that maps them onto the parameters.
void save_sharded(distributed::ParallelModel& parallel, const CheckpointSave& save) {
  distributed::ProcessGroup& world = *parallel.mesh().world();
  const bool rank0 = world.rank() == 0;
  const fs::path final_dir = save.path;
  // Every rank writes into one temporary directory, named by rank 0's pid and host (so a killed run's is found and
  // removed, and never a live one of another host).
  Tensor owner = from_vector<int64_t>({int64_t(::getpid()), int64_t(io::host_id())}, {2}).to(parallel.device());
  world.broadcast(owner, 0);
  const std::vector<int64_t> o = to_vector<int64_t>(owner);
  const fs::path tmp = final_dir.parent_path() / (std::string(io::kTempPrefix) + final_dir.filename().string() + "." +
                                                  io::temp_owner_tag(o[0], uint32_t(o[1])));
  if (rank0) {
    if (!final_dir.parent_path().empty()) fs::create_directories(final_dir.parent_path());
    for (const std::string& stale : remove_stale_checkpoint_dirs(final_dir.parent_path().string()))
      if (!save.quiet) std::cout << "removed the temporary of an interrupted checkpoint: " << stale << "\n";
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world.barrier();

  io::TensorMap tensors;
  nlohmann::json piece_json = nlohmann::json::object();
  for (const distributed::StatePiece& p : parallel.state_pieces()) {
    // Pieces are f32 (what the reader takes): a frozen base held in another dtype is widened, exactly.
    tensors["model." + p.name] = p.value.to(Device()).to(kF32);
    tensors["exp_avg." + p.name] = p.exp_avg.to(Device());
    tensors["exp_avg_sq." + p.name] = p.exp_avg_sq.to(Device());
    piece_json[p.name] = {p.tensor_rank, p.lo, p.hi};
  }
  for (auto& [name, t] : fp8_states(parallel)) tensors[name] = t;
  io::save_safetensors((tmp / rank_file(world.rank())).string(), tensors,
                       {{"format", "loom-checkpoint-shard-1"}, {"rank", std::to_string(world.rank())},
                        {"pieces", piece_json.dump()}});
  world.barrier();  // every rank file is complete

  if (rank0) {
    const std::map<std::string, int64_t> adam_steps = parallel.adam_steps();
    const distributed::MeshShape& shape = parallel.mesh().shape();
    CheckpointMeta meta;
    meta.step = save.step;
    meta.state_json = save.state_json;
    meta.config_json = parallel.model().config().to_json();
    meta.model = save.model;
    meta.layout = {world.size(), shape.data(), shape.tensor, parallel.plan().data.zero_stage, shape.pipeline};
    meta.optimizer_step = parallel.optimizer().step_count();
    meta.lr = parallel.optimizer().lr();
    const auto named = parallel.model().named_parameters();
    std::map<std::string, size_t> index_of;
    for (auto& [name, p] : named) {
      index_of[name] = meta.params.size();
      CheckpointParam cp;
      cp.name = name;
      cp.split = split_of(parallel, name);
      cp.shape = full_shape_of(p.shape(), cp.split);
      cp.adam_step = adam_steps.at(name);
      meta.params.push_back(std::move(cp));
    }
    for (int64_t r = 0; r < world.size(); ++r) {  // each rank's file says which pieces it holds
      meta.files.push_back(rank_file(r));
      io::SafetensorsReader f((tmp / meta.files.back()).string());
      const auto& md = f.metadata();
      LOOM_REQUIRE(md.count("pieces"), "save_checkpoint: '", f.path(), "' lacks its pieces");
      const nlohmann::json held = io::parse_json(md.at("pieces"), "save_checkpoint: '" + f.path() + "': pieces");
      for (auto& [name, q] : held.items()) {
        auto it = index_of.find(name);  // every rank's model has every name (a pipeline stage's others as stand-ins)
        LOOM_REQUIRE(it != index_of.end(), "save_checkpoint: rank ", r, " saved parameter '", name,
                     "' that rank 0's model lacks");
        meta.params[it->second].pieces.push_back(
            {r, io::json_int(q.at(0)), io::json_int(q.at(1)), io::json_int(q.at(2))});
      }
    }
    const std::string text = meta.to_json();
    CheckpointMeta::parse(text, (tmp / kCheckpointMetaFile).string());  // every part covered, before it counts
    io::write_file_atomic((tmp / kCheckpointMetaFile).string(), text);
    if (fs::exists(final_dir)) {  // --overwrite-checkpoints: the old one goes once the new one is complete
      LOOM_REQUIRE(is_sharded_checkpoint(final_dir.string()), "save_checkpoint: '", save.path,
                   "' exists and is not a sharded checkpoint; it is not replaced");
      io::check_output_dir(final_dir.string());
      const fs::path old = final_dir.parent_path() / (std::string(io::kTempPrefix) + "old." +
                                                      final_dir.filename().string() + "." + std::to_string(::getpid()));
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      fs::remove_all(old);
    } else {
      fs::rename(tmp, final_dir);
    }
    point_latest_at(final_dir, save.checkpoint_dir);
    if (!save.quiet) std::cout << "saved checkpoint " << save.path << " (" << world.size() << " shards)" << std::endl;
  }
  world.barrier();  // nobody goes on (or reads it) before it is in place
}

void check_steps_left(const CheckpointState& st, const std::string& path, const CheckpointResume& resume) {
  LOOM_REQUIRE(resume.eval_only || st.step < resume.steps, "resume: '", path, "' is at step ", st.step,
               ", nothing left to train with --steps ", resume.steps, " (raise --steps to train further)");
}

CheckpointState load_single(distributed::ParallelModel& parallel, const std::string& path,
                            const CheckpointResume& resume) {
  io::SafetensorsFile file = io::load_safetensors_file(path);
  LOOM_REQUIRE(is_loom_checkpoint(file), "resume: '", path, "' is not a Loom training checkpoint (no format=",
               kCheckpointFormat, " in its metadata)");
  auto state_it = file.metadata.find("state");
  LOOM_REQUIRE(state_it != file.metadata.end(), "resume: '", path, "' has no state metadata");
  // Everything is read and checked before the first parameter changes.
  const CheckpointState st = parse_checkpoint_state(state_it->second, path);
  check_steps_left(st, path, resume);
  auto model_params = parallel.full_parameters();  // collective
  std::vector<Tensor> weights = checkpoint_weights(file, path, "resume", model_params);
  optim::OptimizerState state;
  const std::string shard_path = optimizer_shard_path(path, parallel.mesh().world()->rank());
  const bool one_process = parallel.mesh().world()->size() == 1;
  std::error_code ec;
  io::SafetensorsFile shard;
  if (parallel.optimizer_state_per_rank() || (!one_process && fs::exists(shard_path, ec)))
    shard = io::load_safetensors_file(shard_path);
  for (auto& [name, t] : (parallel.optimizer_state_per_rank() ? shard : file).tensors)
    if (name.rfind("optim.", 0) == 0) state[name.substr(6)] = t;
  CheckpointState out = st;
  restore_fp8_states(parallel, with_prefix((one_process ? file : shard).tensors, "fp8."), true, path, out.notes);
  std::vector<std::pair<std::string, Tensor>> loaded;
  for (size_t i = 0; i < model_params.size(); ++i) loaded.emplace_back(model_params[i].first, weights[i]);
  parallel.load_full_parameters(loaded);
  parallel.load_optimizer_state(state);
  return out;
}

CheckpointState load_sharded(distributed::ParallelModel& parallel, const std::string& dir,
                             const CheckpointResume& resume) {
  ShardedCheckpointReader ck(dir);
  const CheckpointMeta& meta = ck.meta();
  // Everything is read and checked before the first parameter changes.
  CheckpointState st = parse_checkpoint_state(meta.state_json, dir);
  check_steps_left(st, dir, resume);
  const std::string difference =
      config_difference(meta.config_json, parallel.model().config().to_json(), "checkpoint config");
  LOOM_REQUIRE(difference.empty(), "resume: '", dir, "' was saved from another model: config ", difference,
               " (a checkpoint reshards to any world size and layout, but not to another model)");
  auto named = parallel.model().named_parameters();
  LOOM_REQUIRE(named.size() == meta.params.size(), "resume: '", dir, "' holds ", meta.params.size(),
               " parameters, the model has ", named.size());
  std::map<std::string, TpSplit> split;
  for (auto& [name, p] : named) {
    split[name] = split_of(parallel, name);
    const Shape full = full_shape_of(p.shape(), split[name]);
    LOOM_REQUIRE(meta.param(name).shape == full, "resume: parameter '", name, "' in '", dir, "' has shape ",
                 shape_str(meta.param(name).shape), ", the model has ", shape_str(full));
  }
  // The data position in windows of B x T tokens: another data-parallel size continues at the same window.
  const int64_t dp = parallel.mesh().shape().data();
  if (meta.layout.dp != dp) {
    LOOM_REQUIRE(!resume.shuffle, "resume: '", dir, "' was saved by ", meta.layout.dp,
                 " data-parallel ranks and this run has ", dp, ": with --shuffle the batch order depends on that "
                 "number, resume with ", meta.layout.dp, " data-parallel ranks or without --shuffle");
    LOOM_REQUIRE(st.batch_offset * meta.layout.dp % dp == 0, "resume: '", dir, "' stopped after ",
                 st.batch_offset * meta.layout.dp, " batch windows of its data shard, which ", dp,
                 " data-parallel ranks cannot continue from (not a multiple of ", dp, ")");
    st.batch_offset = st.batch_offset * meta.layout.dp / dp;
  }
  // The FP8 scaling state from this rank's own file, where the same layout saved it (independent of the parameters,
  // so checked and restored before they change).
  const distributed::MeshShape& shape = parallel.mesh().shape();
  const CheckpointLayout& saved = meta.layout;
  const int64_t rank = parallel.mesh().world()->rank();
  bool same_layout = saved.world == parallel.mesh().world()->size() && saved.dp == dp &&
                     saved.tp == shape.tensor && saved.pp == shape.pipeline &&
                     saved.zero == parallel.plan().data.zero_stage && rank < int64_t(meta.files.size());
  for (auto& [name, s] : split)  // and each parameter split as it was (experts over the same expert ranks)
    same_layout = same_layout && meta.param(name).split.sharded == s.sharded &&
                  (!s.sharded || meta.param(name).split.ranks == s.ranks);
  io::TensorMap fp8;
  if (same_layout) {
    io::SafetensorsReader file((fs::path(dir) / meta.files[size_t(rank)]).string());
    for (auto& [name, entry] : file.entries())
      if (name.rfind("fp8.", 0) == 0) fp8[name] = file.read(name);
  }
  restore_fp8_states(parallel, fp8, same_layout, dir, st.notes);
  parallel.load_state_pieces(
      [&](const std::string& name, const char* kind, int64_t lo, int64_t hi) {
        return ck.read(name, kind, split.at(name), parallel.split_part(name), lo, hi);
      },
      meta.optimizer_step, meta.lr, [&](const std::string& name) { return meta.param(name).adam_step; });
  return st;
}

}  // namespace

void save_checkpoint(distributed::ParallelModel& parallel, const CheckpointSave& save) {
  autograd::NoGradGuard ng;
  // The last guard (the run checked its targets at the start): a checkpoint that appeared since is not replaced.
  LOOM_REQUIRE(save.overwrite || !fs::exists(save.path), "save_checkpoint: '", save.path,
               "' exists; not written over it (pass --overwrite-checkpoints to replace checkpoints)");
  if (fs::path(save.path).extension() == ".safetensors") save_single(parallel, save);
  else save_sharded(parallel, save);
}

CheckpointState load_checkpoint(distributed::ParallelModel& parallel, const std::string& path,
                                const CheckpointResume& resume) {
  autograd::NoGradGuard ng;
  return fs::is_directory(path) ? load_sharded(parallel, path, resume) : load_single(parallel, path, resume);
}

}  // namespace loom::train
