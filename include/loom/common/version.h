// Loom's version and what this build holds, for every app's --version.
#pragma once

#include <string>

namespace loom {

// "0.1.0": the project version of CMakeLists.txt.
const char* version();
// The git commit the build was made from ("3f2a1b0c9d8e", "-dirty" after it when tracked files differed from it),
// "unknown" outside a git checkout.
const char* git_commit();
// Lines for --version: "<app> <version> (commit <commit>, <build type>)", then the CUDA toolkit, runtime and driver
// versions with the CUDA architectures built, cuDNN and NCCL (or that this build has no CUDA).
std::string version_text(const std::string& app);

}  // namespace loom
