// What every Loom app's command line shares: --version, errors as one "APP: error: ..." line on stderr, an unknown
// flag answered with the nearest known one, and the run of the app's body with every exception turned into that line.
//
//   CLI::App app{"loom-foo: ..."};
//   ... add options ...
//   if (int rc = loom::cli::parse(app, "loom-foo", argc, argv); rc >= 0) return rc;
//   return loom::cli::run("loom-foo", [&] { ... });
#pragma once

#include <CLI/CLI.hpp>

#include "checked_options.h"  // apps::error_text: an exception in Loom's words

#include <functional>
#include <string>
#include <vector>

namespace loom::cli {

// Adds --version (loom::version_text) and the range check of integer options (checked_options.h), parses, and
// returns -1 when the app should go on; otherwise the exit status to return: 0 after --help or --version (printed on
// stdout), 2 after a bad command line (one error line).
int parse(CLI::App& app, const std::string& name, int argc, char** argv);

// What parse does before parsing: --version and the range check of integer options.
void prepare(CLI::App& app, const std::string& name);

// Runs `parse_call` (app.parse of some arguments) and returns "" when the app should go on, else the message of a bad
// command line, as parse prints it. --help and --version propagate (CLI::Success, CLI::CallForVersion).
std::string parse_args(CLI::App& app, const std::string& name, const std::function<void()>& parse_call);

// The message as print_error prints it after "APP: error: ": one line, a leading "APP: " or "error: " dropped.
std::string error_line(const std::string& name, const std::string& message);

// The flags of `app` whose values are outputs (--dump-logits, --checkpoint-dir, ...): declared before parse(), which
// otherwise takes every value that names an existing file (or a pattern of files) as an input of the run
// (note_command_line_inputs), so that no output, the exit report's file included, replaces it even when the run
// stops before reading it.
void output_options(const CLI::App& app, const std::vector<std::string>& flags);
void note_command_line_inputs(const CLI::App& app);

// The environment's settings of the library, read here at the app's edge (the library reads no variable of these):
// LOOM_PROFILE_OPS (1, or shapes) turns per-op profiling on with its report at exit, and LOOM_PROFILE_OPS_FILE
// names the file the report is also written to. parse() calls it after a command line that parsed.
void profile_ops_from_environment();

// Prints "APP: error: <message>" as one line: a message that starts with "APP: " says the name once, and the lines
// of a message of several are joined with "; ".
void print_error(const std::string& name, const std::string& message);

// Runs the app's body: returns 0, or 1 after printing what it threw as one error line (std::bad_alloc as running out
// of host memory).
int run(const std::string& name, const std::function<void()>& body);

// The name in `known` nearest to `typed` (dashes and underscores alike): the one whose words' initials spell it
// ("learning-rate" -> "lr"), else the one fewest edits away when that is few for its length; "" when none is near.
std::string nearest_name(const std::string& typed, const std::vector<std::string>& known);

// The long flags of `app` ("--lr", ...), for nearest_name.
std::vector<std::string> long_flags(const CLI::App& app);

}  // namespace loom::cli
