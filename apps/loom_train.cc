// loom-train: trains a GPT-2 or LLaMA model on llm.c token shards. See docs/TRAINING.md.
#include <CLI/CLI.hpp>

#include "cli/cli.h"
#include "cli/train_args.h"
#include "loom/io/input_guard.h"
#include "loom/train/trainer.h"

int main(int argc, char** argv) {
  loom::io::protect_inputs();  // no output of this run replaces a file it read
  loom::cli::TrainArgs args;
  CLI::App app{"loom-train: train a GPT-2 or LLaMA-3 language model on llm.c token shards (docs/TRAINING.md)"};
  if (int rc = loom::cli::run("loom-train", [&] { loom::cli::add_train_options(app, args); }); rc != 0) return rc;
  if (int rc = loom::cli::parse(app, "loom-train", argc, argv); rc >= 0) return rc;
  try {
    loom::cli::finish_train_options(app, args);
  } catch (const std::exception& e) {
    loom::cli::print_error("loom-train", e.what());
    return 2;
  }
  return loom::cli::run("loom-train", [&] {
    loom::cli::load_train_libraries(args);
    loom::train::Trainer trainer(args.options);
    trainer.run();
  });
}
