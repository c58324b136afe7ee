// Sharded checkpoints: the format (meta.json), the resharding arithmetic and the readers (loom/train/checkpoint.h).
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/train/checkpoint.h"

#include "loom/io/read_file.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/io/atomic_file.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/model.h"
#include "io/json_numbers.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

bool splits(const TpSplit& s) { return s.sharded && s.ranks > 1; }

int64_t product(const Shape& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

void check_split(const Shape& full, const TpSplit& s) {
  if (!splits(s)) return;
  LOOM_REQUIRE(s.dim >= 0 && size_t(s.dim) < full.size(), "checkpoint: a split along dim ", s.dim, " of a parameter of ",
               "shape ", shape_str(full));
  int64_t total = 0;
  for (int64_t b : s.blocks) {
    LOOM_REQUIRE(b >= 0 && b % s.ranks == 0, "checkpoint: a block of ", b, " along dim ", s.dim, " of shape ",
                 shape_str(full), " does not split into ", s.ranks, " equal pieces");
    total += b;
  }
  LOOM_REQUIRE(total == full[size_t(s.dim)], "checkpoint: blocks of ", total, " along dim ", s.dim, " of shape ",
               shape_str(full));
}

// Along the split dim: where each piece of rank `rank`'s part lies in the part (local) and in the full tensor.
struct Segment {
  int64_t local, full, length;
};
std::vector<Segment> segments(int64_t full_size, const TpSplit& s, int64_t rank) {
  if (!splits(s)) return {{0, 0, full_size}};
  std::vector<Segment> out;
  int64_t start = 0, local = 0;
  for (int64_t block : s.blocks) {
    const int64_t piece = block / s.ranks;
    out.push_back({local, start + rank * piece, piece});
    local += piece;
    start += block;
  }
  return out;
}

}  // namespace

Shape tp_local_shape(const Shape& full, const TpSplit& split) {
  check_split(full, split);
  Shape out = full;
  if (splits(split)) out[size_t(split.dim)] /= split.ranks;
  return out;
}

std::vector<CopyRun> tp_copy_runs(const Shape& full_shape, const TpSplit& dst_split, int64_t dst_rank, int64_t dst_lo,
                                  int64_t dst_hi, const TpSplit& src_split, int64_t src_rank) {
  const Shape full = full_shape.empty() ? Shape{1} : full_shape;
  check_split(full, dst_split);
  check_split(full, src_split);
  LOOM_REQUIRE(!splits(dst_split) || !splits(src_split) || dst_split.dim == src_split.dim,
               "checkpoint: cannot reshard a parameter of shape ", shape_str(full), " split along dim ", src_split.dim,
               " into one split along dim ", dst_split.dim);
  const int64_t dim = splits(dst_split) ? dst_split.dim : splits(src_split) ? src_split.dim : 0;
  const int64_t outer = product(full, 0, size_t(dim)), inner = product(full, size_t(dim) + 1, full.size());
  const int64_t size = full[size_t(dim)];
  const int64_t dst_len = splits(dst_split) ? size / dst_split.ranks : size;
  const int64_t src_len = splits(src_split) ? size / src_split.ranks : size;
  LOOM_REQUIRE(dst_lo >= 0 && dst_lo <= dst_hi && dst_hi <= outer * dst_len * inner, "checkpoint: elements [", dst_lo,
               ", ", dst_hi, ") outside a part of ", outer * dst_len * inner);
  std::vector<CopyRun> runs;
  if (dst_lo == dst_hi || inner == 0) return runs;
  // The pieces the two parts share along the dim, in destination order.
  struct Shared {
    int64_t dst, src, length;
  };
  std::vector<Shared> shared;
  for (const Segment& d : segments(size, dst_split, dst_rank))
    for (const Segment& s : segments(size, src_split, src_rank)) {
      const int64_t a = std::max(d.full, s.full), b = std::min(d.full + d.length, s.full + s.length);
      if (a < b) shared.push_back({d.local + a - d.full, s.local + a - s.full, b - a});
    }
  std::sort(shared.begin(), shared.end(), [](const Shared& x, const Shared& y) { return x.dst < y.dst; });
  // Only the outer rows that meet [dst_lo, dst_hi): a ZeRO shard's part costs its own size, not the parameter's.
  const int64_t row = dst_len * inner;
  for (int64_t o = dst_lo / row; o <= (dst_hi - 1) / row && o < outer; ++o)
    for (const Shared& sh : shared) {
      const int64_t dst = (o * dst_len + sh.dst) * inner, src = (o * src_len + sh.src) * inner;
      const int64_t lo = std::max(dst, dst_lo), hi = std::min(dst + sh.length * inner, dst_hi);
      if (lo >= hi) continue;
      CopyRun r{lo, src + lo - dst, hi - lo};
      if (!runs.empty() && runs.back().dst + runs.back().length == r.dst && runs.back().src + runs.back().length == r.src)
        runs.back().length += r.length;
      else
        runs.push_back(r);
    }
  return runs;
}

void assemble_part(const CheckpointParam& p, const TpSplit& split, int64_t rank, int64_t lo, int64_t hi, float* out,
                   const std::function<void(const CheckpointPiece&, int64_t, int64_t, float*)>& fetch) {
  const int64_t saved_ranks = splits(p.split) ? p.split.ranks : 1;
  int64_t filled = 0;
  for (int64_t src_rank = 0; src_rank < saved_ranks; ++src_rank) {
    std::vector<const CheckpointPiece*> pieces;  // of this part, by position
    for (const CheckpointPiece& piece : p.pieces)
      if (!splits(p.split) || piece.tp_rank == src_rank) pieces.push_back(&piece);
    std::sort(pieces.begin(), pieces.end(), [](auto* a, auto* b) { return a->lo < b->lo; });
    for (const CopyRun& run : tp_copy_runs(p.shape, split, rank, lo, hi, p.split, src_rank)) {
      // The run may span pieces (ZeRO shard boundaries): each piece gives what it holds of it.
      auto it = std::upper_bound(pieces.begin(), pieces.end(), run.src,
                                 [](int64_t v, const CheckpointPiece* piece) { return v < piece->lo; });
      if (it != pieces.begin()) --it;
      for (; it != pieces.end() && (*it)->lo < run.src + run.length; ++it) {
        const int64_t a = std::max(run.src, (*it)->lo), b = std::min(run.src + run.length, (*it)->hi);
        if (a >= b) continue;
        fetch(**it, a - (*it)->lo, b - a, out + (run.dst - lo) + (a - run.src));
        filled += b - a;
      }
    }
  }
  LOOM_REQUIRE(filled == hi - lo, "checkpoint: parameter '", p.name, "': the saved pieces cover ", filled, " of the ",
               hi - lo, " elements asked for (a piece is missing)");
}

// ---- meta.json ----

std::string CheckpointMeta::to_json() const {
  nlohmann::ordered_json params_json = nlohmann::ordered_json::array();
  for (const CheckpointParam& p : params) {
    nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
    for (const CheckpointPiece& piece : p.pieces) pieces.push_back({piece.file, piece.tp_rank, piece.lo, piece.hi});
    nlohmann::ordered_json split = nullptr;
    if (p.split.sharded) split = {{"dim", p.split.dim}, {"blocks", p.split.blocks}};
    // A split over another dimension than the tensor one (an expert weight over the expert ranks) says its parts.
    if (p.split.sharded && p.split.ranks != layout.tp) split["parts"] = p.split.ranks;
    params_json.push_back({{"name", p.name}, {"shape", p.shape}, {"split", split}, {"adam_step", p.adam_step},
                           {"pieces", pieces}});
  }
  nlohmann::ordered_json j{
      {"format", format},
      {"step", step},
      {"state", nlohmann::ordered_json::parse(state_json)},
      {"model", model},
      {"config", nlohmann::ordered_json::parse(config_json)},
      {"layout", {{"world", layout.world}, {"dp", layout.dp}, {"tp", layout.tp}, {"zero", layout.zero},
                  {"pp", layout.pp}}},
      {"optimizer", {{"step", optimizer_step}, {"lr", lr}}},
      {"files", files},
      {"parameters", params_json}};
  return j.dump(1) + "\n";
}

CheckpointMeta CheckpointMeta::parse(const std::string& json_text, const std::string& path) {
  CheckpointMeta m;
  try {
    const nlohmann::json j = io::parse_json(json_text, "checkpoint: '" + path + "': " + kCheckpointMetaFile);
    m.format = j.at("format").get<std::string>();
    LOOM_REQUIRE(m.format == kShardedCheckpointFormat, "checkpoint: '", path, "' has format '", m.format,
                 "', this Loom reads ", kShardedCheckpointFormat);
    m.step = io::json_int(j.at("step"));
    m.state_json = j.at("state").dump();
    m.model = j.at("model").get<std::string>();
    m.config_json = j.at("config").dump();
    const auto& l = j.at("layout");
    m.layout = {io::json_int(l.at("world")), io::json_int(l.at("dp")), io::json_int(l.at("tp")),
                io::json_int(l.at("zero")), l.contains("pp") ? io::json_int(l.at("pp")) : 1};
    m.optimizer_step = io::json_int(j.at("optimizer").at("step"));
    m.lr = j.at("optimizer").at("lr").get<double>();
    m.files = j.at("files").get<std::vector<std::string>>();
    for (const auto& pj : j.at("parameters")) {
      CheckpointParam p;
      p.name = pj.at("name").get<std::string>();
      p.shape = io::json_ints(pj.at("shape"));
      if (!pj.at("split").is_null()) {
        p.split.sharded = true;
        p.split.dim = io::json_int(pj.at("split").at("dim"));
        p.split.blocks = io::json_ints(pj.at("split").at("blocks"));
      }
      p.split.ranks = p.split.sharded && pj.at("split").contains("parts") ? io::json_int(pj.at("split").at("parts"))
                                                                           : m.layout.tp;
      p.adam_step = io::json_int(pj.at("adam_step"));
      for (const auto& q : pj.at("pieces")) {
        LOOM_REQUIRE(q.is_array() && q.size() == 4, "checkpoint: '", path, "': parameter '", p.name,
                     "' has a piece that is not [file, tp_rank, lo, hi]: ", io::json_excerpt(q));
        p.pieces.push_back({io::json_int(q[0]), io::json_int(q[1]), io::json_int(q[2]), io::json_int(q[3])});
      }
      m.params.push_back(std::move(p));
    }
  } catch (const nlohmann::json::exception& e) {  // not JSON, an entry missing or of the wrong type
    LOOM_THROW("checkpoint: '", path, "' has a corrupt ", kCheckpointMetaFile, ": ", io::json_error_text(e));
  }
  const CheckpointLayout& l = m.layout;
  int64_t pp_dp = 0, pp_dp_tp = 0;  // in 64 bits without overflow: the sizes come from the file
  const bool layout_fits = !__builtin_mul_overflow(l.pp, l.dp, &pp_dp) && !__builtin_mul_overflow(pp_dp, l.tp, &pp_dp_tp);
  LOOM_REQUIRE(l.world >= 1 && l.dp >= 1 && l.tp >= 1 && l.pp >= 1 && layout_fits && l.world == pp_dp_tp && l.zero >= 0 &&
                   l.zero <= 3 &&
                   int64_t(m.files.size()) == l.world && m.step >= 0 && m.optimizer_step >= 0,
               "checkpoint: '", path, "' has a corrupt ", kCheckpointMetaFile, ": layout world ", l.world, " = pp ",
               l.pp, " x dp ", l.dp, " x tp ", l.tp, ", zero ", l.zero, ", ", m.files.size(), " files, step ", m.step);
  for (const std::string& f : m.files)
    LOOM_REQUIRE(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", "checkpoint: '", path,
                 "' names a rank file '", f, "' outside its directory");
  // Every part of every parameter tiled exactly once by its pieces: a reader can trust any range it asks for.
  for (const CheckpointParam& p : m.params) {
    const std::string where = "checkpoint: '" + path + "': parameter '" + p.name + "'";
    for (int64_t d : p.shape) LOOM_REQUIRE(d >= 0, where, " has a negative size in ", shape_str(p.shape));
    LOOM_REQUIRE(p.split.ranks >= 1 && p.split.ranks <= l.world, where, " is split into ", p.split.ranks,
                 " parts over ", l.world, " ranks");
    Shape local;
    try {
      local = tp_local_shape(p.shape, p.split);
    } catch (const Error& e) {
      LOOM_THROW(where, ": ", e.what());
    }
    const int64_t numel = product(local, 0, local.size());
    const int64_t parts = splits(p.split) ? p.split.ranks : 1;
    LOOM_REQUIRE(p.adam_step >= 0, where, " has AdamW step ", p.adam_step);
    for (int64_t part = 0; part < parts; ++part) {
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (const CheckpointPiece& q : p.pieces) {
        LOOM_REQUIRE(q.file >= 0 && q.file < l.world && q.tp_rank >= 0 && q.tp_rank < std::max(parts, l.tp) &&
                         q.lo >= 0 &&
                         q.lo < q.hi && q.hi <= numel,
                     where, " has a piece [file ", q.file, ", tp rank ", q.tp_rank, ", ", q.lo, ", ", q.hi,
                     ") outside its ", numel, " elements per part or its ", l.world, " files");
        if (!splits(p.split) || q.tp_rank == part) ranges.emplace_back(q.lo, q.hi);
      }
      std::sort(ranges.begin(), ranges.end());
      int64_t at = 0;
      for (auto [lo, hi] : ranges) {
        LOOM_REQUIRE(lo == at, where, ": its pieces of tensor-parallel part ", part, lo < at ? " overlap" : " leave a gap",
                     " at element ", std::min(lo, at));
        at = hi;
      }
      LOOM_REQUIRE(at == numel, where, ": its pieces of tensor-parallel part ", part, " cover ", at, " of ", numel,
                   " elements");
    }
  }
  return m;
}

const CheckpointParam& CheckpointMeta::param(const std::string& name) const {
  for (const CheckpointParam& p : params)
    if (p.name == name) return p;
  LOOM_THROW("checkpoint: no parameter '", name, "' (saved from a different model?)");
}

bool is_sharded_checkpoint(const std::string& path) {
  std::error_code ec;
  return !path.empty() && fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / kCheckpointMetaFile, ec);
}

// ---- reading ----

struct ShardedCheckpointReader::Files {
  std::map<int64_t, std::unique_ptr<io::SafetensorsReader>> open;
};

ShardedCheckpointReader::ShardedCheckpointReader(std::string dir)
    : dir_(std::move(dir)), files_(std::make_unique<Files>()) {
  const fs::path meta_path = fs::path(dir_) / kCheckpointMetaFile;
  std::error_code exists_ec;
  LOOM_REQUIRE(fs::exists(meta_path, exists_ec), "checkpoint: '", dir_, "' has no readable ", kCheckpointMetaFile,
               " (not a sharded checkpoint)");
  meta_ = CheckpointMeta::parse(io::read_input_file(meta_path.string(), io::kMaxConfigFileBytes, "checkpoint metadata"),
                                meta_path.string());
  io::note_input(dir_);
  // Every rank file the metadata names is there (a partial copy would otherwise fail mid-load, or not at all when
  // a rank's pieces are never read).
  std::error_code ec;
  for (const std::string& f : meta_.files) {
    LOOM_REQUIRE(fs::is_regular_file(fs::path(dir_) / f, ec), "checkpoint: '", dir_, "': ", kCheckpointMetaFile,
                 " names rank file '", f, "', which is not there (an incomplete copy?)");
    io::note_input((fs::path(dir_) / f).string());  // read whole or in part: no output replaces it
  }
}

ShardedCheckpointReader::~ShardedCheckpointReader() = default;

Tensor ShardedCheckpointReader::read(const std::string& name, const std::string& kind, const TpSplit& split,
                                     int64_t rank, int64_t lo, int64_t hi) {
  LOOM_REQUIRE(kind == "model" || kind == "exp_avg" || kind == "exp_avg_sq", "checkpoint: unknown kind '", kind, "'");
  const CheckpointParam& p = meta_.param(name);
  Tensor out = empty({hi - lo}, kF32);
  const std::string tensor = kind + "." + name;
  assemble_part(p, split, rank, lo, hi, out.data_ptr<float>(),
                [&](const CheckpointPiece& piece, int64_t first, int64_t count, float* dst) {
                  auto& reader = files_->open[piece.file];
                  if (!reader)
                    reader = std::make_unique<io::SafetensorsReader>(
                        (fs::path(dir_) / meta_.files[size_t(piece.file)]).string());
                  const io::SafetensorsReader::Entry& e = reader->entry(tensor);
                  LOOM_REQUIRE(e.dtype == kF32 && e.shape == Shape{piece.hi - piece.lo}, "checkpoint: '",
                               reader->path(), "': tensor '", tensor, "' is ", dtype_name(e.dtype), " ",
                               shape_str(e.shape), ", its piece in ", kCheckpointMetaFile, " is f32 [",
                               piece.hi - piece.lo, "]");
                  reader->read_elements(tensor, first, count, dst);
                });
  return out;
}

Tensor ShardedCheckpointReader::read_full(const std::string& name, const std::string& kind) {
  const CheckpointParam& p = meta_.param(name);
  return read(name, kind, TpSplit{}, 0, 0, product(p.shape, 0, p.shape.size())).view(p.shape);
}

void load_sharded_weights(const std::string& dir, nn::LanguageModel& model, const char* what) {
  ShardedCheckpointReader reader(dir);
  std::vector<std::string> saved;
  for (const CheckpointParam& p : reader.meta().params) saved.push_back(p.name);
  nn::hold_fp8_as_saved(model, saved);  // a frozen base held in FP8: its codes and scales
  auto named = model.named_parameters();
  LOOM_REQUIRE(named.size() == reader.meta().params.size(), what, ": '", dir, "' holds ", reader.meta().params.size(),
               " parameters, the model has ", named.size(), " (saved from a different model?)");
  std::vector<Tensor> values;  // every one read and checked before the first changes
  for (auto& [name, p] : named) {
    const CheckpointParam& saved = reader.meta().param(name);
    LOOM_REQUIRE(saved.shape == p.shape(), what, ": parameter '", name, "' in '", dir, "' has shape ",
                 shape_str(saved.shape), ", the model has ", shape_str(p.shape()));
    values.push_back(reader.read_full(name, "model"));
  }
  autograd::NoGradGuard ng;
  for (size_t i = 0; i < named.size(); ++i) named[i].second.copy_from(values[i]);
}

std::shared_ptr<nn::LanguageModel> load_sharded_model(const std::string& dir) {
  ShardedCheckpointReader reader(dir);
  std::shared_ptr<nn::LanguageModel> model;
  {
    nn::SkipInit loaded;  // every weight comes from the checkpoint
    model = nn::make_model(nn::ModelConfig::from_json(reader.meta().config_json));
  }
  load_sharded_weights(dir, *model, "checkpoint");
  return model;
}

std::string resolve_checkpoint(const std::string& path, const std::string& what) {
  std::error_code ec;
  LOOM_REQUIRE(!path.empty(), what, ": no checkpoint named");
  LOOM_REQUIRE(fs::exists(path, ec), what, ": '", path, "' does not exist");
  if (!fs::is_directory(path, ec) || is_sharded_checkpoint(path) || io::is_hf_model_dir(path)) return path;
  const fs::path latest = fs::path(path) / "latest";
  LOOM_REQUIRE(fs::symlink_status(latest, ec).type() != fs::file_type::not_found, what, ": '", path,
               "' holds no checkpoint: no 'latest' file (a run's "
               "checkpoint directory), no ", kCheckpointMetaFile, " (a sharded step directory) and no config.json (a "
               "Hugging Face model directory)");
  const std::string name = read_latest_name(path, what);
  const fs::path target = fs::path(path) / name;
  LOOM_REQUIRE(fs::exists(target, ec), what, ": '", latest.string(), "' names '", name, "', which does not exist");
  return target.string();
}

std::string read_latest_name(const std::string& dir, const std::string& what, const std::string& pointer) {
  const fs::path latest = fs::path(dir) / pointer;
  std::error_code ec;
  // Only an absent entry is "no latest": one that is there but cannot be read as a file (a directory, a link that
  // loops or dangles) is said as the file reader says it.
  if (fs::symlink_status(latest, ec).type() == fs::file_type::not_found) return "";
  // Not an input: the run that resumes from it rewrites it.
  std::string text = io::read_input_file(latest.string(), io::kMaxSmallFileBytes, what + ": checkpoint pointer",
                                         io::FileUse::kUpdated);
  std::string name = text.substr(0, text.find('\n'));
  if (!name.empty() && name.back() == '\r') name.pop_back();  // written on Windows (CRLF)
  const bool plain = !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
                     name.find_first_of(std::string("/\0", 2)) == std::string::npos;
  LOOM_REQUIRE(plain, what, ": '", latest.string(), "' does not name a checkpoint of its directory (it holds '",
               name.substr(0, 80), name.size() > 80 ? "...'" : "'",
               "; it must hold one file or directory name such as step_000100.safetensors)");
  return name;
}

std::shared_ptr<nn::LanguageModel> load_model_from(const std::string& path, const std::string& what) {
  const std::string resolved = resolve_checkpoint(path, what);
  return is_sharded_checkpoint(resolved) ? load_sharded_model(resolved) : io::load_model(resolved);
}

std::vector<std::string> remove_stale_checkpoint_dirs(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  const std::string prefix = std::string(io::kTempPrefix) + "step_";
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0 || !it->is_directory(ec) || it->is_symlink(ec)) continue;
    std::error_code tec;
    const auto mtime = fs::last_write_time(it->path(), tec);
    if (tec || !io::temp_writer_gone(name.substr(name.rfind('.') + 1), mtime, io::process_start_time())) continue;
    std::error_code rec;
    fs::remove_all(it->path(), rec);
    if (!rec) removed.push_back(it->path().string());
  }
  return removed;
}

}  // namespace loom::train
