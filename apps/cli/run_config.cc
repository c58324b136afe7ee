// loom-train's config files (run_config.h): TOML through toml++, JSON through nlohmann/json, both mapped through the
// trainer's table of settings.
#include "cli/run_config.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "cli/cli.h"
#include "loom/common/error.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"
#include "loom/train/trainer.h"

namespace loom::cli {

namespace {

// "batch_size" -> "batch-size": keys are compared as flags are spelled.
std::string flag_of(std::string key) {
  for (char& c : key) c = c == '_' ? '-' : c;
  return key;
}

// "batch-size" -> "batch_size": how keys are shown.
std::string key_of(std::string flag) {
  for (char& c : flag) c = c == '-' ? '_' : c;
  return flag;
}

std::string number_text(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// One key of the file: where it is ("run.toml:3" or "run.json"), its place in the file (the line, or for JSON the
// key's number in file order), the section it is in ("" at the top) and its values.
struct Entry {
  std::string where;
  int64_t order = 0;
  std::string section, key;
  std::vector<std::string> values;
};

// torchtitan's own spellings: taken as Loom's setting (`flag`), or refused with what Loom has instead (`hint`).
// key nullptr: every key of the section.
struct Foreign {
  const char* section;
  const char* key;
  const char* flag;
  const char* hint;
};
constexpr const char* kModelHint =
    "Loom names a model with one key: model = \"d12\", \"gpt2-xl\", \"llama3-8b\" (loom-train --help lists them) or "
    "the path of a model config JSON";
constexpr const char* kDataHint =
    "Loom trains on token shards: train_data = \"data/train_*.bin\" (loom-prepare makes them from text or JSON Lines)";
constexpr Foreign kForeign[] = {
    {"job", "dump_folder", nullptr, "[job] is torchtitan's; Loom writes to checkpoint_dir ([checkpoint]) and log_dir "
                                    "([metrics])"},
    {"job", nullptr, nullptr, "[job] is torchtitan's; Loom has no such section (remove it)"},
    {"lr_scheduler", "warmup_steps", "warmup", nullptr},
    {"lr_scheduler", "decay_type", "decay", nullptr},
    {"lr_scheduler", "min_lr_factor", "final-lr-fraction", nullptr},
    {"lr_scheduler", "lr_min", "final-lr-fraction", nullptr},
    {"lr_scheduler", nullptr, nullptr, "Loom's schedule is warmup, decay, final_lr_fraction and schedule_steps in "
                                       "[optimizer]"},
    {"training", "warmup_steps", "warmup", nullptr},
    {"training", "local_batch_size", "batch-size", nullptr},
    {"training", "max_norm", "clip", nullptr},
    {"training", "global_batch_size", nullptr, "Loom counts tokens per step: total_batch_tokens = the global batch "
                                               "x seq_len"},
    {"training", "dataset", nullptr, kDataHint},
    {"training", "dataset_path", nullptr, kDataHint},
    {"training", "mixed_precision_param", nullptr, "Loom's compute precision is dtype = \"bf16\" in [training]"},
    {"checkpoint", "folder", "checkpoint-dir", nullptr},
    {"checkpoint", "interval", "checkpoint-interval", nullptr},
    {"checkpoint", "keep_latest_k", "keep-checkpoints", nullptr},
    {"checkpoint", "enable", nullptr, "Loom saves checkpoints whenever checkpoint_dir is set"},
    {"checkpoint", "enable_checkpoint", nullptr, "Loom saves checkpoints whenever checkpoint_dir is set"},
    {"metrics", "log_freq", "log-interval", nullptr},
    {"metrics", "enable_tensorboard", nullptr, "Loom writes TensorBoard events whenever log_dir is set"},
    {"metrics", "save_tb_folder", nullptr, "Loom writes TensorBoard events and metrics.jsonl into log_dir"},
    {"model", "name", nullptr, kModelHint},
    {"model", "flavor", nullptr, kModelHint},
    {"optimizer", "name", nullptr, "Loom's optimizer is AdamW (lr, beta1, beta2, eps, weight_decay)"},
};

const Foreign* foreign(const std::string& section, const std::string& key) {
  const std::string s = flag_of(section), k = flag_of(key);
  for (const Foreign& f : kForeign)
    if (flag_of(f.section) == s && (!f.key || flag_of(f.key) == k)) return &f;
  return nullptr;
}

// Checks every key against the settings table and turns the entries into CLI11 items. Every mistake is noted; the
// file's mistakes are reported together, in file order (items()).
class Mapper {
 public:
  // origins: where each setting's key is (flag -> "run.toml:3: batch_size"), when wanted.
  explicit Mapper(std::string path, std::map<std::string, std::string>* origins = nullptr)
      : path_(std::move(path)), origins_(origins) {
    for (const train::SettingName& s : train::run_setting_names()) {
      section_of_[s.flag] = s.section;
      sections_.insert(s.section);
    }
  }

  // Loom's sections and torchtitan's that Loom maps ([lr_scheduler], [job]).
  bool is_section(const std::string& name) const {
    return sections_.count(flag_of(name)) > 0 ||
           std::any_of(std::begin(kForeign), std::end(kForeign),
                       [&](const Foreign& f) { return flag_of(f.section) == flag_of(name); });
  }

  void fail(const std::string& where, int64_t order, const std::string& what) {
    errors_.push_back({order, "--config " + where + ": " + what});
  }

  std::string section_list() const {
    std::string out;
    for (const std::string& s : sections_) out += (out.empty() ? "[" : ", [") + s + "]";
    return out;
  }

  void unknown_section(const std::string& where, int64_t order, const std::string& name) {
    std::vector<std::string> known(sections_.begin(), sections_.end());
    const std::string near = nearest_name(name, known);
    fail(where, order, "unknown section [" + name + "]" + (near.empty() ? "" : " (did you mean [" + near + "]?)") +
                           "; the sections are " + section_list());
  }

  void add(const Entry& e) {
    std::string flag = flag_of(e.key);
    const std::string in = e.section.empty() ? "" : " in [" + e.section + "]";
    bool placed = false;  // a torchtitan key taken as Loom's: its section is torchtitan's
    if (const Foreign* f = e.section.empty() ? nullptr : foreign(e.section, e.key)) {
      if (!f->flag)
        return fail(e.where, e.order, "'" + e.key + "'" + in + " is torchtitan's: " + f->hint);
      flag = f->flag;
      placed = true;
    }
    const auto it = section_of_.find(flag);
    if (it == section_of_.end()) {
      std::vector<std::string> known;
      for (const auto& [f, s] : section_of_)
        if (e.section.empty() || s == flag_of(e.section)) known.push_back(key_of(f));
      const std::string near = nearest_name(e.key, known);
      return fail(e.where, e.order,
                  "unknown key '" + e.key + "'" + in + (near.empty() ? "" : " (did you mean '" + near + "'?)") +
                      "; the keys are loom-train's long flags (loom-train --help)");
    }
    if (!placed && !e.section.empty() && it->second != flag_of(e.section))
      return fail(e.where, e.order, "'" + e.key + "' belongs in [" + it->second + "], not [" + e.section + "]");
    if (!seen_.insert(flag).second)
      return fail(e.where, e.order,
                  "'" + e.key + "' is set twice" + (flag_of(e.key) == flag ? "" : " (it is Loom's " + key_of(flag) + ")"));
    if (origins_) (*origins_)[flag] = e.where + ": " + e.key;
    CLI::ConfigItem item;
    item.name = flag;
    item.inputs = e.values;
    items_.push_back(std::move(item));
  }

  const std::string& path() const { return path_; }

  // The items; or every mistake, in file order, one line each.
  std::vector<CLI::ConfigItem> items() && {
    if (!errors_.empty()) {
      std::stable_sort(errors_.begin(), errors_.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      std::string text;
      for (const auto& [order, line] : errors_) text += (text.empty() ? "" : "\n") + line;
      throw CLI::ConfigError(text);
    }
    return std::move(items_);
  }

 private:
  std::string path_;
  std::map<std::string, std::string>* origins_;
  std::map<std::string, std::string> section_of_;  // flag -> section
  std::set<std::string> sections_;
  std::set<std::string> seen_;
  std::vector<CLI::ConfigItem> items_;
  std::vector<std::pair<int64_t, std::string>> errors_;
};

// ---- TOML ----

std::string toml_where(const std::string& path, const toml::source_region& at) {
  return path + ":" + std::to_string(at.begin.line);
}

std::optional<std::string> toml_scalar(const toml::node& v) {
  switch (v.type()) {
    case toml::node_type::string: return std::string(*v.value<std::string_view>());
    case toml::node_type::integer: return std::to_string(*v.value<int64_t>());
    case toml::node_type::floating_point: return number_text(*v.value<double>());
    case toml::node_type::boolean: return *v.value<bool>() ? "true" : "false";
    default: return std::nullopt;
  }
}

// The entry of a key, or nullopt when its value is none a setting takes (noted).
std::optional<Entry> toml_entry(Mapper& m, const std::string& section, const toml::key& key, const toml::node& value) {
  Entry e{toml_where(m.path(), key.source()), int64_t(key.source().begin.line), section, std::string(key.str()), {}};
  if (const toml::array* list = value.as_array()) {
    for (const toml::node& v : *list) {
      std::optional<std::string> s = toml_scalar(v);
      if (!s) {
        m.fail(e.where, e.order, "'" + e.key + "' must be a list of strings, numbers or booleans");
        return std::nullopt;
      }
      e.values.push_back(*s);
    }
  } else if (std::optional<std::string> s = toml_scalar(value)) {
    e.values.push_back(*s);
  } else {
    m.fail(e.where, e.order, "'" + e.key + "' must be a string, number, boolean or a list of them");
    return std::nullopt;
  }
  return e;
}

std::vector<CLI::ConfigItem> read_toml(const std::string& path, const std::string& text,
                                       std::map<std::string, std::string>* origins) {
  toml::table doc;
  try {
    doc = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    throw CLI::ConfigError("--config " + toml_where(path, e.source()) + ": not valid TOML: " +
                           std::string(e.description()));
  }
  Mapper m(path, origins);
  std::vector<Entry> entries;  // taken in file order (toml++ keeps a section's keys sorted by name)
  auto line_of = [](const toml::key& k) { return int64_t(k.source().begin.line); };
  for (const auto& [key, value] : doc) {
    if (const toml::table* section = value.as_table()) {
      const std::string name(key.str());
      if (!m.is_section(name)) {
        m.unknown_section(toml_where(path, key.source()), line_of(key), name);
        continue;
      }
      for (const auto& [k, v] : *section) {
        if (v.is_table()) {
          m.unknown_section(toml_where(path, k.source()), line_of(k), name + "." + std::string(k.str()));
          continue;
        }
        if (auto e = toml_entry(m, name, k, v)) entries.push_back(std::move(*e));
      }
    } else if (auto e = toml_entry(m, "", key, value)) {
      entries.push_back(std::move(*e));
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.order < b.order; });
  for (const Entry& e : entries) m.add(e);
  return std::move(m).items();
}

// ---- JSON ----

void json_entry(Mapper& m, int64_t order, const std::string& section, const std::string& key,
                const nlohmann::ordered_json& value) {
  Entry e{m.path(), order, section, key, {}};
  bool ok = true;
  auto scalar = [&](const nlohmann::ordered_json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_boolean() || v.is_number()) return v.dump();
    if (ok)
      m.fail(e.where, order, "'" + key + "' must be a string, number, boolean or a list of them, got " +
                                 io::json_excerpt(nlohmann::json::parse(v.dump())));
    ok = false;
    return "";
  };
  if (value.is_array())
    for (const auto& v : value) e.values.push_back(scalar(v));
  else
    e.values.push_back(scalar(value));
  if (ok) m.add(e);
}

std::vector<CLI::ConfigItem> read_json(const std::string& path, const std::string& text,
                                       std::map<std::string, std::string>* origins) {
  try {
    io::parse_json(text, "--config " + path);  // nesting bounded, a repeated key refused
  } catch (const Error& e) {
    throw CLI::ConfigError(e.what());
  }
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text);  // the keys in file order
  Mapper m(path, origins);
  if (!doc.is_object()) {
    m.fail(path, 0, "must hold a JSON object of settings, got " + std::string(doc.type_name()));
    return std::move(m).items();
  }
  int64_t order = 0;
  for (const auto& [key, value] : doc.items()) {
    if (value.is_object()) {
      if (!m.is_section(key)) {
        m.unknown_section(path, order++, key);
        continue;
      }
      for (const auto& [k, v] : value.items()) {
        if (v.is_object()) m.unknown_section(path, order++, key + "." + k);
        else json_entry(m, order++, key, k, v);
      }
    } else {
      json_entry(m, order++, "", key, value);
    }
  }
  return std::move(m).items();
}

std::vector<CLI::ConfigItem> read_config(const std::string& path, const std::string& text,
                                         std::map<std::string, std::string>* origins) {
  const auto dot = path.find_last_of('.');
  const std::string ext = dot == std::string::npos ? "" : path.substr(dot);
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json = ext == ".json" || (ext != ".toml" && first != std::string::npos && text[first] == '{');
  return json ? read_json(path, text, origins) : read_toml(path, text, origins);
}

// CLI11 hands the formatter the file's stream; the path comes from --config itself, for the messages.
class RunConfigFormatter : public CLI::Config {
 public:
  RunConfigFormatter(const CLI::App& app, const CLI::Option* config) : app_(app), config_(config) {}

  // Where the file set `flag`, where the command line did not (config_origin).
  std::string origin(const std::string& flag) const {
    const auto it = origins_.find(flag);
    return it == origins_.end() ? "" : it->second;
  }

  std::string to_config(const CLI::App*, bool, bool, std::string) const override { return ""; }

  // The file is read again by its path, the one bounded way (a regular file of at most kMaxConfigFileBytes):
  // CLI11's stream of /dev/zero never ends.
  std::vector<CLI::ConfigItem> from_config(std::istream&) const override {
    const std::string path = config_->results().empty() ? "" : config_->results().back();
    std::string text;
    try {
      text = io::read_input_file(path, io::kMaxConfigFileBytes, "--config");
    } catch (const Error& e) {
      throw CLI::ConfigError(e.what());
    }
    // CLI11 reads the file after the command line: a setting given there already is the command line's.
    std::map<std::string, std::string> origins;
    std::vector<CLI::ConfigItem> items = read_config(path, text, &origins);
    origins_.clear();
    for (const auto& [flag, where] : origins)
      if (const CLI::Option* opt = app_.get_option_no_throw("--" + flag); opt && opt->count() == 0)
        origins_[flag] = where;
    return items;
  }

 private:
  const CLI::App& app_;
  const CLI::Option* config_;
  mutable std::map<std::string, std::string> origins_;
};

}  // namespace

std::vector<CLI::ConfigItem> read_run_config(const std::string& path, const std::string& text) {
  return read_config(path, text, nullptr);
}

std::string config_origin(const CLI::App& app, const std::string& flag) {
  const auto* formatter = dynamic_cast<const RunConfigFormatter*>(app.get_config_formatter().get());
  return formatter ? formatter->origin(flag) : "";
}

void add_run_config(CLI::App& app) {
  // Every configurable long option is a setting of the table and every setting an option.
  std::set<std::string> flags, options;
  for (const train::SettingName& s : train::run_setting_names()) flags.insert(s.flag);
  for (const CLI::Option* opt : app.get_options())
    if (opt->get_configurable() && !opt->get_lnames().empty()) options.insert(opt->get_lnames().front());
  options.erase("help");
  for (const std::string& o : options)
    LOOM_CHECK(flags.count(o), "--", o, " is not in the trainer's table of settings (run_setting_table)");
  for (const std::string& f : flags)
    LOOM_CHECK(options.count(f), "setting '", f, "' of run_setting_table has no flag");
  CLI::Option* config = app.set_config("--config", "",
                                       "read settings from a TOML file ([model], [training], [optimizer], "
                                       "[checkpoint], [metrics] and [parallelism] sections, or flat keys) or the "
                                       "same in JSON; keys are the long flags (batch_size or batch-size); the "
                                       "command line wins (docs/TRAINING.md)");
  config->configurable(false);
  app.config_formatter(std::make_shared<RunConfigFormatter>(app, config));
  app.allow_config_extras(CLI::config_extras_mode::error);
}

}  // namespace loom::cli
