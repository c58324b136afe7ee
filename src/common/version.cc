// Loom's version and build (loom/common/version.h). CMake defines the version, build type and CUDA architectures
// for this file only, and writes the commit into loom_git_commit.h at every build (cmake/GitCommit.cmake).
#include "loom/common/version.h"

#include <sstream>

#include "loom_git_commit.h"

#ifdef LOOM_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cudnn_attention.h"
#endif
#ifdef LOOM_WITH_NCCL
#include <nccl.h>
#endif

#ifndef LOOM_VERSION
#define LOOM_VERSION "unknown"
#endif
#ifndef LOOM_BUILD_TYPE
#define LOOM_BUILD_TYPE "unknown build type"
#endif

namespace loom {

namespace {

#if defined(LOOM_WITH_CUDA) || defined(LOOM_WITH_NCCL)
// CUDA's 12080 as "12.8"; cuDNN's and NCCL's 91900 / 22703 as "9.19.0" / "2.27.3".
std::string cuda_version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }
std::string library_version_str(int v) {
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}
#endif

}  // namespace

const char* version() { return LOOM_VERSION; }

const char* git_commit() { return LOOM_GIT_COMMIT; }

std::string version_text(const std::string& app) {
  std::ostringstream out;
  out << app << " " << version() << " (commit " << git_commit() << ", " << LOOM_BUILD_TYPE << ")\n";
#ifdef LOOM_WITH_CUDA
  int runtime = 0, driver = 0;
  const bool have_runtime = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
  const bool have_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0;
  out << "CUDA: built with " << cuda_version_str(CUDART_VERSION) << ", runtime "
      << (have_runtime ? cuda_version_str(runtime) : "unknown") << ", driver "
      << (have_driver ? cuda_version_str(driver) : "none found") << "; architectures " << LOOM_CUDA_ARCHITECTURES
      << "\n";
  const size_t cudnn = cuda::cudnn_attention::version();
  out << "cuDNN: " << (cudnn > 0 ? library_version_str(int(cudnn)) + " (loaded at run time)" : "not found (optional)")
      << "\n";
#else
  out << "CUDA: not built (LOOM_CUDA=OFF): CPU only\n";
#endif
#ifdef LOOM_WITH_NCCL
  int nccl = 0;
  ncclGetVersion(&nccl);
  out << "NCCL: " << library_version_str(nccl) << " (built with " << library_version_str(NCCL_VERSION_CODE) << ")\n";
#elif defined(LOOM_WITH_CUDA)
  out << "NCCL: not built (nccl.h was not found): no multi-GPU training\n";
#endif
  return out.str();
}

}  // namespace loom
