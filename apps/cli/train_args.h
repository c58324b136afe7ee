// loom-train's settings as command-line options: one option per setting of the trainer's table
// (train::run_setting_names), with the checks of each value, and --config FILE (run_config.h). loom-train parses its
// command line with them; the Python package (loom.Trainer) reads a dict or a config file through the same options,
// so a setting means the same, and is checked the same, wherever it comes from.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "loom/train/train_options.h"

namespace loom::cli {

struct TrainArgs {
  train::TrainOptions options;
  std::string tf32;                          // --tf32 on|off ("" when not given)
  std::vector<std::string> diopi_libraries;  // --load-diopi
};

// Adds every loom-train option to `app`, bound to `args`, and --config (add_run_config).
void add_train_options(CLI::App& app, TrainArgs& args);

// After a parse: the settings given (TrainOptions::given, from the options that took a value) and --tf32; throws
// loom::Error naming a required setting that is missing (--train-data but for --eval-only with --val-data).
void finish_train_options(const CLI::App& app, TrainArgs& args);

// The settings that `args` (as loom-train's command line takes them, without the program name: {"--config",
// "run.toml", "--steps=10"}) give; throws loom::Error with loom-train's one-line message for a bad one.
TrainArgs parse_train_args(const std::vector<std::string>& args);

// What --load-diopi asks for: loads each library (an error when this Loom has no DIOPI bridge).
void load_train_libraries(const TrainArgs& args);

}  // namespace loom::cli
