// Running an app as a user does, for the tests of the apps on bad inputs: its exit status, stdout and stderr, the
// check that an error is one line naming what was wrong, and a snapshot of a directory's files to show nothing changed.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <string>

#include "test_files.h"

namespace loom::test {

struct AppRun {
  int status = 0;
  std::string out, err;
};

// Runs a shell command line with stdin from /dev/null.
inline AppRun run_app(const std::string& command) {
  TempDir tmp;
  const std::string err = tmp.file("stderr");
  AppRun r;
  FILE* p = popen((command + " </dev/null 2>" + err).c_str(), "r");
  if (!p) return {-1, "", "popen failed"};
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.out.append(buf.data(), n);
  r.status = pclose(p);
  r.err = read_all(err);
  return r;
}

// A non-zero exit, and stderr's last line holding every part (no raw JSON or filesystem exception text).
inline void expect_one_line_error(const std::string& command, std::initializer_list<std::string> parts) {
  SCOPED_TRACE(command);
  AppRun r = run_app(command);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) != 0) << r.out << r.err;
  // Progress and banner lines may come first; the error is the last line, and it holds every part.
  const std::string last = r.err.substr(r.err.rfind('\n', r.err.size() >= 2 ? r.err.size() - 2 : 0) + 1);
  EXPECT_TRUE(!r.err.empty() && r.err.back() == '\n') << r.err;
  for (const auto& p : parts) EXPECT_NE(last.find(p), std::string::npos) << "missing '" << p << "' in\n" << r.err;
  EXPECT_EQ(r.err.find("[json.exception"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("filesystem error"), std::string::npos) << r.err;
}

// Every regular file under `dir` (recursively) with its bytes.
inline std::map<std::string, std::string> files_of(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[e.path().string()] = read_all(e.path().string());
  return out;
}

}  // namespace loom::test
