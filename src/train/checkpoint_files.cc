// A checkpoint's files and a run's checkpoint directory: metadata probes, the training state, the targets a run may
// write and the retention of old checkpoints (loom/train/training_checkpoint.h).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_numbers.h"
#include "loom/autograd/grad_mode.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/llmc_model.h"
#include "loom/io/safetensors.h"
#include "loom/train/checkpoint.h"
#include "loom/train/training_checkpoint.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

// Whether a file's safetensors header says it is a Loom training checkpoint: the header alone, so a checkpoint whose
// data was cut short still counts (--overwrite-checkpoints may replace a broken checkpoint, never a file of another
// kind that happens to have a checkpoint's name).
bool has_checkpoint_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  if (!in.read(reinterpret_cast<char*>(&header_len), sizeof header_len) || header_len > (uint64_t(100) << 20))
    return false;
  std::string header(size_t(header_len), '\0');
  if (!in.read(header.data(), std::streamsize(header_len))) return false;
  try {
    const nlohmann::json j = io::parse_json(header, path);
    return j.is_object() && j.contains("__metadata__") && j["__metadata__"].is_object() &&
           j["__metadata__"].value("format", "") == kCheckpointFormat;
  } catch (const std::exception&) {
    return false;
  }
}

// The run id in a checkpoint's state metadata (file or sharded directory); "" when it has none or is unreadable.
std::string checkpoint_run_id(const std::string& path) {
  try {
    std::string state;
    if (fs::is_directory(path)) {
      state = ShardedCheckpointReader(path).meta().state_json;
    } else {
      io::SafetensorsReader file(path);  // the header only
      auto it = file.metadata().find("state");
      if (it == file.metadata().end()) return "";
      state = it->second;
    }
    const nlohmann::json j = io::parse_json(state, path);
    return j.is_object() && j.contains("run_id") && j["run_id"].is_string() ? j["run_id"].get<std::string>() : "";
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

bool is_loom_checkpoint(const io::SafetensorsFile& file) {
  auto fmt = file.metadata.find("format");
  return fmt != file.metadata.end() && fmt->second == kCheckpointFormat;
}

std::vector<Tensor> checkpoint_weights(const io::SafetensorsFile& file, const std::string& path, const char* what,
                                       const std::vector<std::pair<std::string, Tensor>>& params) {
  std::vector<Tensor> out;
  for (const auto& [name, p] : params) {
    auto it = file.tensors.find("model." + name);
    LOOM_REQUIRE(it != file.tensors.end(), what, ": '", path, "' lacks parameter '", name,
                 "' (was it saved from a different model?)");
    // A held FP8 weight's codes are u8, and load into such codes only.
    LOOM_REQUIRE(is_floating(it->second.dtype()) || it->second.dtype() == p.dtype(), what, ": parameter '", name,
                 "' in '", path, "' has dtype ", dtype_name(it->second.dtype()), ", a weight must be floating point");
    LOOM_REQUIRE(it->second.shape() == p.shape(), what, ": parameter '", name, "' in '", path, "' has shape ",
                 shape_str(it->second.shape()), ", the model has ", shape_str(p.shape()));
    out.push_back(it->second);
  }
  return out;
}

void load_checkpoint_weights(const io::SafetensorsFile& file, const std::string& path, const char* what,
                             nn::LanguageModel& model) {
  nn::hold_fp8_as_saved(model, io::checkpoint_parameter_names(file));
  autograd::NoGradGuard ng;
  auto params = model.named_parameters();
  std::vector<Tensor> weights = checkpoint_weights(file, path, what, params);
  for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_from(weights[i]);
}

std::string loom_checkpoint_config(const std::string& path) {
  if (path.empty()) return "";
  if (is_sharded_checkpoint(path)) return ShardedCheckpointReader(path).meta().config_json;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || io::is_llmc_model_file(path)) return "";
  try {
    io::SafetensorsReader file(path);  // the header only
    const auto& md = file.metadata();
    const auto format = md.find("format"), config = md.find("config");
    return format != md.end() && format->second == kCheckpointFormat && config != md.end() ? config->second : "";
  } catch (const Error&) {
    return "";
  }
}

std::pair<std::string, std::string> checkpoint_state_and_config(const std::string& path) {
  if (fs::is_directory(path)) {
    const CheckpointMeta meta = ShardedCheckpointReader(path).meta();
    return {meta.state_json, meta.config_json};
  }
  io::SafetensorsReader file(path);  // the header only
  const auto& md = file.metadata();
  LOOM_REQUIRE(md.count("format") && md.at("format") == kCheckpointFormat, "resume: '", path,
               "' is not a Loom training checkpoint (no format=", kCheckpointFormat, " in its metadata)");
  LOOM_REQUIRE(md.count("state"), "resume: '", path, "' has no state metadata");
  return {md.at("state"), md.count("config") ? md.at("config") : ""};
}

std::string config_difference(const std::string& saved_json, const std::string& mine_json, const std::string& what) {
  const nlohmann::json saved = io::parse_json(saved_json, what), mine = nlohmann::json::parse(mine_json);
  for (auto& [k, v] : saved.items())
    if (!mine.contains(k) || mine.at(k) != v)
      return "'" + k + "' is " + io::json_excerpt(v) + " in the checkpoint, " +
             (mine.contains(k) ? io::json_excerpt(mine.at(k)) : "absent") + " here";
  for (auto& [k, v] : mine.items())
    if (!saved.contains(k)) return "'" + k + "' is absent in the checkpoint, " + io::json_excerpt(v) + " here";
  return "";
}

CheckpointState parse_checkpoint_state(const std::string& state_json, const std::string& path) {
  CheckpointState st;
  try {
    const nlohmann::json meta = io::parse_json(state_json, "resume: '" + path + "' has corrupt state metadata");
    const auto& l = meta.at("loader");
    const auto& rng = meta.at("rng");
    st.step = io::json_int(meta.at("step"));
    st.shard_index = io::json_int(l.at("shard_index"));
    st.batch_offset = io::json_int(l.at("batch_offset"));
    st.epoch = io::json_int(l.at("epoch"));
    st.loader_rng = io::json_uint(l.at("rng_state"));
    st.rng_seed = io::json_uint(rng.at("seed"));
    st.rng_offset = io::json_uint(rng.at("offset"));
    if (meta.contains("run_id")) st.run_id = meta.at("run_id").get<std::string>();
    if (meta.contains("settings")) {
      LOOM_REQUIRE(meta.at("settings").is_object(), "resume: '", path, "' has corrupt state metadata: settings is ",
                   io::json_excerpt(meta.at("settings")), ", not an object");
      st.settings_json = meta.at("settings").dump();
    }
  } catch (const nlohmann::json::exception& e) {  // not JSON, an entry missing or of the wrong type
    LOOM_THROW("resume: '", path, "' has corrupt state metadata: ", io::json_error_text(e));
  }
  LOOM_REQUIRE(st.step >= 0 && st.shard_index >= 0 && st.batch_offset >= 0 && st.epoch >= 0, "resume: '", path,
               "' has corrupt state metadata: a negative step (", st.step, ") or data position (shard ",
               st.shard_index, ", batch ", st.batch_offset, ", epoch ", st.epoch, ")");
  return st;
}

std::string tokenizer_content_hash(const std::string& path) {
  if (path.empty()) return "";
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) files = {fs::path(path) / "encoder.json", fs::path(path) / "vocab.bpe"};
  else files = {fs::path(path)};
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  std::vector<char> buf(size_t(1) << 16);
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    LOOM_REQUIRE(in.good(), "tokenizer '", path, "': cannot read '", f.string(), "'");
    while (in.read(buf.data(), std::streamsize(buf.size())) || in.gcount() > 0) {
      for (std::streamsize i = 0; i < in.gcount(); ++i) {
        h ^= uint8_t(buf[size_t(i)]);
        h *= 1099511628211ull;
      }
    }
  }
  char hex[24];
  std::snprintf(hex, sizeof hex, "fnv1a64:%016llx", (unsigned long long)h);
  return hex;
}

std::optional<CheckpointTokenizer> checkpoint_tokenizer(const std::string& path) {
  if (loom_checkpoint_config(path).empty()) return std::nullopt;
  if (!is_sharded_checkpoint(path) && !io::SafetensorsReader(path).metadata().count("state"))
    return std::nullopt;  // weights alone (a saved model, no run): no tokenizer recorded
  const std::string state = checkpoint_state_and_config(path).first;
  const nlohmann::json meta = io::parse_json(state, "'" + path + "': state metadata");
  if (!meta.is_object() || !meta.contains("tokenizer")) return std::nullopt;
  const nlohmann::json& t = meta.at("tokenizer");
  CheckpointTokenizer tok;
  for (auto [key, field] : {std::pair{"name", &tok.name}, std::pair{"path", &tok.path}, std::pair{"hash", &tok.hash}}) {
    LOOM_REQUIRE(t.is_object() && t.contains(key) && t.at(key).is_string(), "'", path,
                 "': the state metadata's tokenizer.", key, " is ",
                 t.is_object() && t.contains(key) ? io::json_excerpt(t.at(key)) : std::string("missing"),
                 ", not a string");
    *field = t.at(key).get<std::string>();
  }
  return tok;
}

std::string recorded_tokenizer_path(const std::string& checkpoint, const CheckpointTokenizer& tok) {
  if (tok.path.empty()) return "";
  std::error_code ec;
  LOOM_REQUIRE(fs::exists(tok.path, ec), "'", checkpoint, "' was trained with the tokenizer '", tok.path,
               "' (its state's tokenizer.path), which is no longer there: give --tokenizer-path");
  const std::string now = tokenizer_content_hash(tok.path);
  LOOM_REQUIRE(tok.hash.empty() || now == tok.hash, "'", checkpoint, "' was trained with the tokenizer '", tok.path,
               "' (its state's tokenizer.path), which has changed since (tokenizer.hash ", tok.hash, ", now ", now,
               "): give --tokenizer-path to use it anyway");
  return tok.path;
}

std::string checkpoint_path(const std::string& dir, int64_t step, bool sharded) {
  char name[64];
  std::snprintf(name, sizeof name, sharded ? "step_%06ld" : "step_%06ld.safetensors", long(step));
  return (fs::path(dir) / name).string();
}

void check_checkpoint_targets(const CheckpointTargets& t) {
  if (t.dir.empty()) return;
  std::error_code ec;
  for (fs::directory_iterator it(t.dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long n = -1;
    char tail = 0;  // "step_%06ld.safetensors" or a sharded "step_%06ld", and nothing after it
    const bool file = std::sscanf(name.c_str(), "step_%ld.safetensors%c", &n, &tail) == 1;
    if (!file && (std::sscanf(name.c_str(), "step_%ld%c", &n, &tail) != 1 || !it->is_directory(ec))) continue;
    if (n < 0) continue;
    const bool written = n > t.from && n <= t.steps && (n == t.steps || (t.interval > 0 && n % t.interval == 0));
    if (!written || checkpoint_path(t.dir, n, t.sharded) != it->path().string()) continue;
    if (t.overwrite) {  // replacing checkpoints is allowed, replacing what this run read is not
      const std::string path = it->path().string();
      const bool directory = it->is_directory(ec);
      const bool checkpoint = directory ? is_sharded_checkpoint(path) : has_checkpoint_header(path);
      LOOM_REQUIRE(checkpoint, "--overwrite-checkpoints: '", path, "' (step ", n, ") is not a Loom checkpoint; ",
                   "it is not replaced: move it, or choose another --checkpoint-dir");
      if (directory) io::check_output_dir(path);
      else io::check_output_file(path);
      continue;
    }
    LOOM_THROW("--checkpoint-dir: this run would write over the existing checkpoint '", it->path().string(),
               "' (step ", n, "); resume from it (--resume ", t.dir,
               "), choose another --checkpoint-dir, or pass --overwrite-checkpoints");
  }
  if (t.overwrite) return;
  // Another run's 'latest' would be repointed at this run's checkpoints (and its resume would continue this one).
  // (The checkpoint resumed from is this run's, whatever id it holds.)
  if (const std::string latest = read_latest_name(t.dir, "--checkpoint-dir"); !latest.empty()) {
    const fs::path other = fs::path(t.dir) / latest;
    const bool resumed_from_it =
        !t.resumed_from.empty() && fs::exists(other, ec) && fs::equivalent(other, t.resumed_from, ec);
    if (!resumed_from_it && fs::exists(other, ec) && checkpoint_run_id(other.string()) != t.run_id)
      LOOM_THROW("--checkpoint-dir: '", t.dir, "' holds another run's checkpoints (latest: ", latest,
                 "); resume it (--resume ", t.dir, "), choose another --checkpoint-dir, or pass "
                 "--overwrite-checkpoints");
  }
}

std::vector<std::string> remove_old_checkpoints(const std::string& dir_name, int64_t keep, const std::string& run_id) {
  // Only what provably belongs to this run goes: a checkpoint whose run id is this run's (never one whose id is
  // missing or unreadable, which may be anyone's file of that name).
  std::vector<std::string> removed;
  if (keep <= 0 || dir_name.empty() || run_id.empty()) return removed;
  const fs::path dir = dir_name;
  std::string latest, best;
  try {
    latest = read_latest_name(dir.string(), "--keep-checkpoints");
    best = read_latest_name(dir.string(), "--keep-checkpoints", "best");  // --keep-best's
  } catch (const Error&) {
    return removed;  // a 'latest' or 'best' that names nothing readable: remove nothing rather than guess
  }
  // Every checkpoint of the directory by step: step_NNNNNN.safetensors files and sharded step_NNNNNN/ directories.
  std::map<long, std::vector<fs::path>, std::greater<>> by_step;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long n = -1;
    if (std::sscanf(name.c_str(), "step_%ld", &n) != 1 || n < 0) continue;
    if (checkpoint_run_id(it->path().string()) != run_id) continue;  // another run's (or one older than run ids)
    // Exactly the names a run writes (not step_N.optim-rank0.safetensors).
    if (name == fs::path(checkpoint_path(dir_name, n, false)).filename().string() ||
        (name == fs::path(checkpoint_path(dir_name, n, true)).filename().string() &&
         is_sharded_checkpoint(it->path().string())))
      by_step[n].push_back(it->path());
  }
  int64_t kept = 0;
  for (auto& [step, paths] : by_step) {
    if (kept++ < keep) continue;
    for (const fs::path& p : paths) {
      // What a resume would read is never removed, nor the checkpoint with the best validation loss.
      if (p.filename().string() == latest || p.filename().string() == best) continue;
      fs::remove_all(p, ec);
      if (p.extension() == ".safetensors") {  // its optimizer files (one per rank, beside it), by their exact names
        const std::string prefix = p.stem().string() + ".optim-rank";
        for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
          const std::string name = it->path().filename().string();
          long rank = -1;
          char tail = 0;
          if (name.rfind(prefix, 0) == 0 &&
              std::sscanf(name.c_str() + prefix.size(), "%ld.safetensors%c", &rank, &tail) == 1 && rank >= 0 &&
              name == prefix + std::to_string(rank) + ".safetensors")
            fs::remove(it->path(), ec);
        }
      }
      removed.push_back(p.string());
    }
  }
  return removed;
}

}  // namespace loom::train
