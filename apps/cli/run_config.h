// loom-train's --config FILE: a TOML file with torchtitan's sections, or the same nesting in JSON,
//
//   [training]                          {"training": {"batch_size": 16, "steps": 300},
//   batch_size = 16                      "optimizer": {"lr": 1e-3}}
//   steps = 300
//   [optimizer]
//   lr = 1e-3
//
// or flat keys (batch_size = 16, {"batch-size": 16}). Keys are the long flags with '_' or '-'; sections and which
// key each holds come from the trainer's table of settings (train::run_setting_names). Values on the command line win.
// torchtitan's own keys are taken where Loom has the setting under another name ([lr_scheduler] warmup_steps,
// [checkpoint] folder, ...) and refused otherwise with Loom's equivalent ([job], [model] name and flavor, ...).
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace loom::cli {

// The file's settings as CLI11 config items named by their flags ("batch-size"), each value as text. Throws
// CLI::ConfigError naming the file (and the line, for TOML) on a syntax error, an unknown section or key, a key in
// another section than its own, a key given twice, or a value that is no string, number, boolean or list of them:
// every such mistake of the file, one per line, in file order (a syntax error alone).
std::vector<CLI::ConfigItem> read_run_config(const std::string& path, const std::string& text);

// Where the config file last read for `app` set `flag` ("batch-size") that the command line did not: "run.toml:3:
// batch_size" (the file, the line for TOML, the key as written), for an error about its value; "" otherwise.
std::string config_origin(const CLI::App& app, const std::string& flag);

// Gives `app` --config FILE read with read_run_config. Call after every option is added: an option that is not in
// the trainer's table of settings (or a setting without an option) is an internal error, so the two never drift.
void add_run_config(CLI::App& app);

}  // namespace loom::cli
