// The apps' shared command-line conventions (cli.h).
#include "cli/cli.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cstdlib>
#include <iostream>
#include <map>
#include <new>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "checked_options.h"
#include "cli/run_config.h"
#include "loom/common/error.h"
#include "loom/common/version.h"
#include "loom/distributed/parallel_plan.h"
#include "loom/distributed/process_group.h"
#include "loom/dispatch_modes.h"
#include "loom/io/input_guard.h"
#include "loom/io/read_file.h"

namespace loom::cli {

namespace {

// "--Learning_Rate=1e-3" -> "learning-rate": how flags are compared.
std::string normalized(std::string flag) {
  flag = flag.substr(0, flag.find('='));
  flag.erase(0, flag.find_first_not_of('-'));
  for (char& c : flag) c = c == '_' ? '-' : char(std::tolower(static_cast<unsigned char>(c)));
  return flag;
}

// Edits (insertion, deletion, substitution, swap of neighbours) that turn a into b.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// "learning-rate" -> "lr".
std::string initials(const std::string& words) {
  std::string out;
  for (size_t i = 0; i < words.size(); ++i)
    if (words[i] != '-' && (i == 0 || words[i - 1] == '-')) out += words[i];
  return out;
}

// What CLI11 says, as one line.
std::string one_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, out;
  while (std::getline(in, line)) {
    line.erase(0, line.find_first_not_of(" \t"));
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
    if (line.empty()) continue;
    out += (out.empty() ? "" : "; ") + line;
  }
  return out;
}

// The first argument CLI11 did not take that looks like a flag (not a negative number), "" when none.
std::string unknown_flag(const CLI::App& app) {
  for (const std::string& arg : app.remaining())
    if (arg.size() > 1 && arg[0] == '-' && !std::isdigit(static_cast<unsigned char>(arg[1])) && arg[1] != '.')
      return arg.substr(0, arg.find('='));
  return "";
}

// CLI11's "The following arguments were not expected: 1e-3 --learning-rate" as what the user most likely meant.
std::string unexpected_arguments(const CLI::App& app, const std::string& name) {
  if (const std::string flag = unknown_flag(app); !flag.empty()) {
    const std::string near = nearest_name(flag, long_flags(app));
    return "unknown flag " + flag + (near.empty() ? "" : " (did you mean " + near + "?)") + "; " + name +
           " --help lists the flags";
  }
  const std::vector<std::string> extra = app.remaining();
  return "unexpected argument '" + (extra.empty() ? std::string() : extra.front()) + "' (each flag takes one value; " +
         name + " --help lists the flags)";
}

// What a value of `opt` must be, from CLI11's type name ("INT:>= 1", "FLOAT:FINITE", "TEXT:{off,all}").
std::string kind_of_value(const CLI::Option& opt) {
  const auto [type, check] = apps::type_and_checks(opt);
  if (type == "INT" || type == "UINT") return "a whole number";
  if (type == "FLOAT") return "a number";
  if (type == "BOOLEAN" || (type.empty() && opt.get_expected_min() == 0)) return "true or false";  // a flag
  if (!check.empty() && check.front() == '{') return "one of " + check;
  return "a value";
}

// CLI11's range ("0.000000 to 179769313486231570814...": its NonNegativeNumber) as a person says it.
std::string range_text(const CLI::Option& opt, const std::string& low_text, const std::string& high_text) {
  const double low = std::strtod(low_text.c_str(), nullptr), high = std::strtod(high_text.c_str(), nullptr);
  const auto [type, check] = apps::type_and_checks(opt);
  const bool whole = type == "INT" || type == "UINT";
  if (high < 1e300) return "from " + apps::exact_number(low) + " to " + apps::exact_number(high);
  // PositiveNumber's low end, the least double, prints as 0: its name tells it from NonNegativeNumber.
  if (check.rfind("POSITIVE", 0) == 0) return whole ? "at least 1" : "greater than 0";
  return "at least " + apps::exact_number(low);
}

// CLI11's messages about one option's value in Loom's words ("--steps: expected a whole number, got 'x'"), and a
// value that came from --config said as the file's, at its line ("--config run.toml:3: steps: ..."): "" for the
// others, which stay as they are.
std::string value_error(const CLI::App& app, const std::string& message) {
  static const std::regex unconverted(R"(^Could not convert: (--[A-Za-z0-9_-]+) = (.*)$)"),
      missing(R"(^(--[A-Za-z0-9_-]+): \d+ required \S+ missing$)"),
      repeated(R"(^(--[A-Za-z0-9_-]+): At Most 1 required but received (\d+)$)"),
      not_bool(R"(^(--[A-Za-z0-9_-]+): Should be true/false or a number$)"),
      range(R"(^(--[A-Za-z0-9_-]+): Value (.*) not in range (\S+) to (\S+)$)");
  std::smatch m;
  std::string what;
  auto opt_of = [&](const std::string& flag) { return app.get_option_no_throw(flag); };
  if (std::regex_match(message, m, unconverted) && opt_of(m[1])) {
    what = "expected " + kind_of_value(*opt_of(m[1])) + ", got '" + m[2].str() + "'";
  } else if (std::regex_match(message, m, missing) && opt_of(m[1])) {
    const std::string kind = kind_of_value(*opt_of(m[1]));
    what = kind == "a value" ? "needs a value" : "needs a value (" + kind + ")";
  } else if (std::regex_match(message, m, repeated)) {
    what = "given " + m[2].str() + " times; it takes one value";
  } else if (std::regex_match(message, m, not_bool)) {
    what = "expected true or false";
  } else if (std::regex_match(message, m, range) && opt_of(m[1])) {
    what = "must be " + range_text(*opt_of(m[1]), m[3].str(), m[4].str()) + ", got " + m[2].str();
  } else {
    return "";
  }
  const std::string flag = m[1];
  const std::string origin = config_origin(app, flag.substr(2));
  return origin.empty() ? flag + ": " + what : "--config " + origin + ": " + what;
}

}  // namespace

std::vector<std::string> long_flags(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* opt : app.get_options())
    for (const std::string& n : opt->get_lnames()) out.push_back("--" + n);
  return out;
}

std::string nearest_name(const std::string& typed, const std::vector<std::string>& known) {
  const std::string t = normalized(typed);
  if (t.empty()) return "";
  for (const std::string& k : known)  // an abbreviation of what was typed: --learning-rate for --lr
    if (t.find('-') != std::string::npos && normalized(k) == initials(t)) return k;
  std::string best;
  size_t best_distance = std::max<size_t>(1, t.size() / 3) + 1;  // more edits than this: not a typo of it
  for (const std::string& k : known) {
    const size_t d = edit_distance(t, normalized(k));
    if (d < best_distance) best_distance = d, best = k;
  }
  return best;
}

void print_error(const std::string& name, const std::string& message) {
  std::cout.flush();
  std::cerr << name << ": error: " << error_line(name, message) << std::endl;
}

void prepare(CLI::App& app, const std::string& name) {
  apps::check_integer_options(app);
  app.set_version_flag("--version", [name] {
    std::string text = version_text(name);
    if (!text.empty() && text.back() == '\n') text.pop_back();  // CLI11 ends it with a newline
    return text;
  }, "print the version, the git commit and the CUDA, cuDNN and NCCL versions and CUDA architectures built, then exit");
}

namespace {
// --batch_size is --batch-size (as config keys and loom-run take them): an underscore spelling of a long flag the
// app has, and does not have as spelt, is read as the flag.
std::vector<std::string> with_underscores_read(const CLI::App& app, std::vector<std::string> args) {
  std::set<std::string> long_names;
  for (const CLI::Option* opt : app.get_options())
    for (const std::string& n : opt->get_lnames()) long_names.insert(n);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    const size_t eq = a.find('=');
    std::string flag = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (flag.find('_') == std::string::npos || long_names.count(flag)) continue;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (long_names.count(flag)) a = "--" + flag + (eq == std::string::npos ? "" : a.substr(eq));
  }
  return args;
}
}  // namespace

std::string parse_args(CLI::App& app, const std::string& name, const std::function<void()>& parse_call) {
  try {
    parse_call();
  } catch (const CLI::ConfigError& e) {  // a config file's mistakes, all of them, one line each in file order
    std::string text = e.what();
    while (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
  } catch (const CLI::FileError& e) {  // --config naming no readable file: said as the file reader says it
    const std::string text = e.what(), suffix = " was not readable (missing?)";
    const size_t at = text.rfind(suffix);
    try {
      if (at != std::string::npos) io::read_input_file(text.substr(0, at), io::kMaxConfigFileBytes, "--config");
      return one_line("--config: " + text);
    } catch (const Error& reason) {
      return one_line(reason.what());
    }
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) throw;  // --help, --version
    // A misspelt required flag is reported as what it is, not as the flag missing.
    const bool unknown = dynamic_cast<const CLI::ExtrasError*>(&e) ||
                         (dynamic_cast<const CLI::RequiredError*>(&e) && !unknown_flag(app).empty());
    if (unknown) return unexpected_arguments(app, name);
    const std::string text = one_line(e.what()), said = value_error(app, text);
    return said.empty() ? text : said;
  } catch (const std::exception& e) {  // a --config reader's failure that is no parse error (memory, a filesystem)
    return one_line(apps::error_text(e));
  } catch (...) {
    return "the command line could not be read (an unexpected error)";
  }
  return "";
}

std::string error_line(const std::string& name, const std::string& message) {
  std::string text = one_line(message);
  const std::string prefix = name + ": ";
  if (text.rfind(prefix, 0) == 0) text.erase(0, prefix.size());
  if (text.rfind("error: ", 0) == 0) text.erase(0, 7);
  return text;
}

int parse(CLI::App& app, const std::string& name, int argc, char** argv) {
  prepare(app, name);
  std::vector<std::string> args = with_underscores_read(app, std::vector<std::string>(argv, argv + argc));
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  std::string error;
  try {
    error = parse_args(app, name, [&] { app.parse(int(arg_ptrs.size()), arg_ptrs.data()); });
  } catch (const CLI::ParseError& e) {
    return app.exit(e);  // --help, --version
  }
  if (!error.empty()) {  // one line per mistake (a config file's several are on lines of their own)
    std::istringstream lines(error);
    for (std::string line; std::getline(lines, line);)
      if (!line.empty()) print_error(name, line);
    return 2;
  }
  note_command_line_inputs(app);
  profile_ops_from_environment();
  return -1;
}

namespace {
std::map<const CLI::App*, std::set<std::string>>& output_flags() {
  static std::map<const CLI::App*, std::set<std::string>> flags;
  return flags;
}
}  // namespace

void output_options(const CLI::App& app, const std::vector<std::string>& flags) {
  for (const std::string& f : flags) output_flags()[&app].insert(f.substr(f.find_first_not_of('-')));
}

void note_command_line_inputs(const CLI::App& app) {
  const std::set<std::string>& outputs = output_flags()[&app];
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->count() == 0 || opt->get_lnames().empty() || outputs.count(opt->get_lnames().front())) continue;
    for (const std::string& value : opt->results()) {
      struct stat st{};
      if (value.empty()) continue;
      if (::stat(value.c_str(), &st) == 0) {
        if (S_ISREG(st.st_mode)) io::note_input(value);
        continue;
      }
      if (value.find_first_of("*?[") == std::string::npos) continue;
      glob_t g{};  // a pattern of files (--train-data "data/*_train_*.bin"): each file it names
      if (::glob(value.c_str(), GLOB_NOSORT, nullptr, &g) == 0)
        for (size_t i = 0; i < g.gl_pathc && i < 100000; ++i)
          if (::stat(g.gl_pathv[i], &st) == 0 && S_ISREG(st.st_mode)) io::note_input(g.gl_pathv[i]);
      ::globfree(&g);
    }
  }
}

void profile_ops_from_environment() {
  const char* mode = std::getenv("LOOM_PROFILE_OPS");
  if (!mode || !*mode || std::string(mode) == "0") return;
  const char* file = std::getenv("LOOM_PROFILE_OPS_FILE");
  dispatch::report_op_profile_at_exit(std::string(mode) == "shapes", file ? file : "", "LOOM_PROFILE_OPS_FILE");
}

int run(const std::string& name, const std::function<void()>& body) {
  try {
    // The exit report's file is checked before the work, not after it.
    dispatch::check_op_profile_file();
    body();
  } catch (const distributed::LayoutError& e) {  // alike on every rank: said by rank 0 only
    int rank = 0;
    try {
      if (const auto launch = distributed::detect_launch()) rank = launch->rank;
    } catch (const std::exception&) {  // a launch the library refuses: every rank speaks
    }
    if (rank == 0) {
      print_error(name, apps::error_text(e));
    } else {
      // mpirun ends the whole job at the first failed rank: the others leave after rank 0 has spoken.
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    return 1;
  } catch (const std::exception& e) {  // loom::Error; a directory that cannot be made, bad_alloc: in Loom's words
    dispatch::report_op_profile_now();  // the exit report, if any, before the error: the error is the last line
    print_error(name, apps::error_text(e));
    return 1;
  } catch (...) {
    dispatch::report_op_profile_now();
    print_error(name, "an unexpected error that is not a std::exception (a plugin library's?)");
    return 1;
  }
  return 0;
}

}  // namespace loom::cli
