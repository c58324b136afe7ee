// Provider "cudnn": scaled dot-product attention forward and backward (the contiguous and the strided ops of
// kernels/attention_kernel.h) on cuDNN 9's fused flash-attention engines, through the backend graph API.
//
// cuDNN is loaded at run time (dlopen("libcudnn.so.9"), a handful of dlsym'd functions); its header gives only types
// and enums. Without the library every kernel here declines and the native kernels serve. Where cuDNN loads, these
// kernels rank above the native flash kernels (cuDNN's Hopper engines are 1.4-2x faster forward + backward on an
// H100); a policy denying "cudnn" (LOOM_PROVIDERS="-cudnn") turns them off, as any provider.
//
// The graphs are the operation graphs cuDNN's SDPA runtime-fusion engines recognise (the layout cudnn-frontend emits
// for its SDPA nodes), built here from the raw backend descriptors:
//   forward:  S = matmul(Q, K^T); S *= scale; [causal: row (+ S_kv - S_q) >= col, else -inf, by GEN_INDEX, CMP_GE,
//             BINARY_SELECT]; M = max_row(S); E = exp(S - M); Z = sum_row(E); Stats = M + log(Z) (the output lse);
//             P = E / Z (16-bit); O = matmul(P, V).
//   backward: Dsum = sum_row(dO * O) * 1; S = matmul(Q, K^T) * scale [causal mask]; P = exp(S - Stats);
//             dV = matmul(reshape(P)^T, dO) (summed over the query heads of a kv head for GQA);
//             dS = (matmul(dO, V^T) * 1 - Dsum) * P * scale; dK = matmul(reshape(dS)^T, Q) (summed likewise);
//             dQacc = matmul(dS, K) (f32, zeroed, F16x16 reordered); dQ = identity(dQacc).
// cuDNN's Stats is the log-sum-exp of each row of scaled (and masked) scores, max included: Loom's lse exactly, so the
// backward takes the lse of whichever forward ran.
//
// Execution plans are cached per shape, strides, dtype, causality and device (the scale and the causal offset are
// passed by value at execution). A graph cuDNN cannot build makes the kernel decline, and the failure is cached too.
#include "kernels/cuda/cudnn_attention.h"

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/attention_kernel.h"
#include "backends/cuda/vendor_writes.h"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#define LOOM_HAVE_CUDNN_HEADER 1
#else
#define LOOM_HAVE_CUDNN_HEADER 0
#endif

namespace loom::cuda::cudnn_attention {

namespace {

std::mutex failure_mu;
std::string failure_text;
std::atomic<int> workspace_fill{-1};  // set_workspace_fill

void note_failure(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(failure_mu);
    failure_text = what;
  }
  static const bool verbose = std::getenv("LOOM_CUDNN_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "loom cudnn attention: %s\n", what.c_str());
}

}  // namespace

std::string last_failure() {
  std::lock_guard<std::mutex> lock(failure_mu);
  return failure_text;
}

void set_workspace_fill(int byte) { workspace_fill.store(byte); }

}  // namespace loom::cuda::cudnn_attention

#if !LOOM_HAVE_CUDNN_HEADER

namespace loom::cuda::cudnn_attention {
bool available() { return false; }
size_t version() { return 0; }
size_t cached_plans() { return 0; }
}  // namespace loom::cuda::cudnn_attention

#else

namespace loom::cuda::cudnn_attention {

namespace {

// ---------------------------------------------------------------------------------------------------------------
// The library, loaded once. Function pointer types come from the header's declarations (nothing is linked).

struct Api {
  decltype(&::cudnnGetVersion) get_version = nullptr;
  decltype(&::cudnnGetErrorString) error_string = nullptr;
  decltype(&::cudnnGetLastErrorString) last_error_string = nullptr;  // optional
  decltype(&::cudnnCreate) create = nullptr;
  decltype(&::cudnnSetStream) set_stream = nullptr;
  decltype(&::cudnnBackendCreateDescriptor) create_descriptor = nullptr;
  decltype(&::cudnnBackendDestroyDescriptor) destroy_descriptor = nullptr;
  decltype(&::cudnnBackendSetAttribute) set_attribute = nullptr;
  decltype(&::cudnnBackendGetAttribute) get_attribute = nullptr;
  decltype(&::cudnnBackendFinalize) finalize = nullptr;
  decltype(&::cudnnBackendExecute) execute = nullptr;
  size_t version = 0;
  bool ok = false;
  std::string why;  // why it is not ok
};

const Api& api() {
  static const Api loaded = [] {
    Api a;
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      a.why = std::string("libcudnn.so.9 not loadable: ") + (e != nullptr ? e : "?");
      return a;
    }
    // Never dlclose'd: plans and handles live until exit.
    bool all = true;
    auto bind = [&](auto& fn, const char* name, bool required) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && required) {
        all = false;
        a.why += std::string(a.why.empty() ? "" : ", ") + "no " + name;
      }
    };
    bind(a.get_version, "cudnnGetVersion", true);
    bind(a.error_string, "cudnnGetErrorString", true);
    bind(a.last_error_string, "cudnnGetLastErrorString", false);
    bind(a.create, "cudnnCreate", true);
    bind(a.set_stream, "cudnnSetStream", true);
    bind(a.create_descriptor, "cudnnBackendCreateDescriptor", true);
    bind(a.destroy_descriptor, "cudnnBackendDestroyDescriptor", true);
    bind(a.set_attribute, "cudnnBackendSetAttribute", true);
    bind(a.get_attribute, "cudnnBackendGetAttribute", true);
    bind(a.finalize, "cudnnBackendFinalize", true);
    bind(a.execute, "cudnnBackendExecute", true);
    if (!all) return a;
    a.version = a.get_version();
    a.ok = a.version >= 90000 && a.version < 100000;
    if (!a.ok) a.why = "cuDNN " + std::to_string(a.version) + " loaded; 9.x needed";
    return a;
  }();
  return loaded;
}

// Where an opt-in check or a plan build fails: caught by the plan builder (the kernel then declines).
struct CudnnFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string status_text(cudnnStatus_t s) {
  const Api& a = api();
  const char* name = a.error_string != nullptr ? a.error_string(s) : nullptr;
  std::string text = std::string(name != nullptr ? name : "unknown status") + " (" + std::to_string(int(s)) + ")";
  if (a.last_error_string != nullptr) {
    char detail[1024] = {0};
    a.last_error_string(detail, sizeof detail);
    if (detail[0] != '\0') text += ": " + std::string(detail);
  }
  return text;
}

// `call` names the cuDNN call (and the descriptor or attribute), `what` the problem shape.
void check(cudnnStatus_t s, const std::string& call, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw CudnnFailure(call + " failed: " + status_text(s) + " [" + what + "]");
}

// Attributes the header marks deprecated (still the way to bind a handle in cuDNN 9), by value to avoid the warning.
constexpr auto kOperationGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);  // CUDNN_ATTR_OPERATIONGRAPH_HANDLE
constexpr auto kExecutionPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);   // CUDNN_ATTR_EXECUTION_PLAN_HANDLE

// ---------------------------------------------------------------------------------------------------------------
// Handles: one per device, bound to the call's stream under its mutex for each execution.

struct HandleSlot {
  std::once_flag once;
  cudnnHandle_t handle = nullptr;
  std::string error;
  std::mutex mu;
};

constexpr int kMaxDevices = 64;
std::array<HandleSlot, kMaxDevices> handle_slots;

// The device's handle, created on first use with the device current; nullptr (and `error`) when that fails.
HandleSlot* handle_slot(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  HandleSlot& slot = handle_slots[size_t(device)];
  std::call_once(slot.once, [&] {
    cuda::DeviceGuard guard(device);
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t s = api().create(&h);
    if (s != CUDNN_STATUS_SUCCESS) {
      slot.error = "cudnnCreate failed on device " + std::to_string(device) + ": " + status_text(s);
      return;
    }
    slot.handle = h;  // never destroyed: destroying at exit races the CUDA runtime's own teardown
  });
  return &slot;
}

// ---------------------------------------------------------------------------------------------------------------
// Descriptors and graphs.

class Desc {
 public:
  Desc(cudnnBackendDescriptorType_t type, const std::string& what) {
    check(api().create_descriptor(type, &d_), "cudnnBackendCreateDescriptor(type " + std::to_string(int(type)) + ")",
          what);
  }
  ~Desc() {
    if (d_ != nullptr) api().destroy_descriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// The uids the variant pack binds.
enum Uid : int64_t {
  kUidQ = 1,
  kUidK,
  kUidV,
  kUidO,
  kUidStats,
  kUidScale,
  kUidMaskValue,
  kUidSkv,
  kUidSq,
  kUidOne,
  kUidDO,
  kUidDQ,
  kUidDK,
  kUidDV,
  kUidDQAccum,
  kFirstVirtualUid = 100,
};

struct Plan {
  bool ok = false;
  std::string failure;
  std::vector<std::unique_ptr<Desc>> keep;  // every descriptor the plan was built from, alive with it
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
  int64_t dq_accum_elements = 0;  // backward: the f32 dQ accumulator cuDNN expects zeroed
  bool causal = false;
  bool bottom_right = false;  // causal with T != S: the row index shifted by S - T
};

class GraphBuilder {
 public:
  explicit GraphBuilder(std::string what) : what_(std::move(what)) {}

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type) {
    keep_.push_back(std::make_unique<Desc>(type, what_));
    return keep_.back()->get();
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* values, const char* label) {
    check(api().set_attribute(d, name, type, count, values),
          std::string("cudnnBackendSetAttribute(") + label + ", attribute " + std::to_string(int(name)) + ")", what_);
  }
  void set_desc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value,
                const char* label) {
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, label);
  }
  void finalize(cudnnBackendDescriptor_t d, const char* label) {
    check(api().finalize(d), std::string("cudnnBackendFinalize(") + label + ")", what_);
  }

  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dtype, const Dims& dims, const Dims& strides,
                                  bool is_virtual, bool by_value = false, bool reorder_f16x16 = false) {
    cudnnBackendDescriptor_t t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype, "tensor data type");
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dimensions");
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    if (is_virtual) {
      const bool yes = true;
      set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes, "tensor is virtual");
    }
    if (by_value) {
      const bool yes = true;
      set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes, "tensor by value");
    }
    if (reorder_f16x16) {
      const cudnnBackendTensorReordering_t mode = CUDNN_TENSOR_REORDERING_F16x16;
      set(t, CUDNN_ATTR_TENSOR_REORDERING_MODE, CUDNN_TYPE_TENSOR_REORDERING_MODE, 1, &mode, "tensor reordering");
    }
    finalize(t, "tensor");
    return t;
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t dtype, const Dims& dims, const Dims& strides) {
    return tensor(next_uid_++, dtype, dims, strides, true);
  }
  // A [1, 1, 1, 1] scalar passed by value (a host pointer in the variant pack).
  cudnnBackendDescriptor_t scalar(int64_t uid, cudnnDataType_t dtype) {
    return tensor(uid, dtype, Dims{1, 1, 1, 1}, Dims{1, 1, 1, 1}, false, true);
  }

  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t compute, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, "pointwise precision");
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    finalize(pw, "pointwise");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, "pointwise op");
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
    if (b != nullptr) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b");
    if (t != nullptr) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
    finalize(op, ("pointwise op mode " + std::to_string(int(mode))).c_str());
    ops_.push_back(op);
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "matmul precision");
    finalize(mm, "matmul");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a");
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul b");
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul c");
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, "matmul op");
    finalize(op, "matmul op");
    ops_.push_back(op);
  }

  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction operator");
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "reduction precision");
    finalize(rd, "reduction");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "reduction op");
    finalize(op, "reduction op");
    ops_.push_back(op);
  }

  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x");
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y");
    finalize(op, "reshape op");
    ops_.push_back(op);
  }

  // Finalizes the operation graph, asks the heuristics (mode A, then the fallback list) for engine configs and keeps
  // the first execution plan that finalizes. Throws CudnnFailure when none does.
  void build(cudnnHandle_t handle, Plan& plan) {
    cudnnBackendDescriptor_t graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data(),
        "operation graph ops");
    set(graph, kOperationGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle");
    finalize(graph, "operation graph");

    std::string first_error;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      cudnnBackendDescriptor_t heur = nullptr;
      std::vector<cudnnBackendDescriptor_t> configs;
      try {
        heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
        set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
        finalize(heur, "heuristics");
        int64_t count = 0;
        check(api().get_attribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                  nullptr),
              "cudnnBackendGetAttribute(heuristics result count)", what_);
        if (count <= 0) {
          if (first_error.empty()) first_error = "heuristics mode " + std::to_string(int(mode)) + " found no engine";
          continue;
        }
        for (int64_t i = 0; i < count; ++i) configs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
        int64_t returned = 0;
        check(api().get_attribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                  &returned, configs.data()),
              "cudnnBackendGetAttribute(heuristics results)", what_);
        configs.resize(size_t(std::max<int64_t>(0, std::min(returned, count))));
      } catch (const CudnnFailure& e) {
        if (first_error.empty()) first_error = e.what();
        continue;
      }
      for (cudnnBackendDescriptor_t config : configs) {
        auto candidate = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, what_);
        cudnnStatus_t s = api().set_attribute(candidate->get(), kExecutionPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle);
        if (s == CUDNN_STATUS_SUCCESS)
          s = api().set_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config);
        if (s == CUDNN_STATUS_SUCCESS) s = api().finalize(candidate->get());
        if (s != CUDNN_STATUS_SUCCESS) {
          if (first_error.empty()) first_error = "cudnnBackendFinalize(execution plan) failed: " + status_text(s);
          continue;
        }
        int64_t workspace = 0, n = 0;
        check(api().get_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                  &n, &workspace),
              "cudnnBackendGetAttribute(execution plan workspace size)", what_);
        plan.plan = candidate->get();
        plan.workspace_bytes = std::max<int64_t>(0, workspace);
        keep_.push_back(std::move(candidate));
        plan.keep = std::move(keep_);
        plan.ok = true;
        return;
      }
    }
    throw CudnnFailure("no execution plan for the graph: " + (first_error.empty() ? "no engine" : first_error) + " [" +
                       what_ + "]");
  }

 private:
  std::string what_;
  std::vector<std::unique_ptr<Desc>> keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_uid_ = kFirstVirtualUid;
};

// ---------------------------------------------------------------------------------------------------------------
// Problems, keys and the plan cache.

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// The strides cuDNN sees: a dim of size 1 gets the stride a packed layout would give it (its stride is never used,
// and cuDNN rejects some values, e.g. 0 on the sequence dim).
Dims strides_of(const Tensor& t) {
  Dims s{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
  if (t.size(3) == 1) s[3] = 1;
  for (int d = 2; d >= 0; --d)
    if (t.size(d) == 1) s[size_t(d)] = s[size_t(d) + 1] * std::max<int64_t>(1, t.size(d + 1));
  return s;
}

// A [B, h, L, D] view cuDNN can read or write: unit D stride, 16-byte aligned start and rows, non-negative strides.
bool layout_ok(const Tensor& t) {
  if (t.dim() != 4 || !aligned16(t)) return false;
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && (t.stride(d) <= 0 || t.stride(d) % 8 != 0)) return false;
  return true;
}

bool like(const Tensor& t, const Tensor& ref) {
  return t.defined() && t.shape() == ref.shape() && t.dtype() == ref.dtype() && t.device() == ref.device() &&
         layout_ok(t);
}

struct Problem {
  int64_t B = 0, H = 0, Hkv = 0, T = 0, S = 0, D = 0;
  bool causal = false;
  DType dtype = kBF16;
  int device = 0;
};

Problem problem_of(const Tensor& q, const Tensor& k, const AttentionAttrs& attrs) {
  return Problem{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), attrs.causal, q.dtype(),
                 q.device().index};
}

std::string describe(const Problem& p, bool backward) {
  return std::string(backward ? "backward" : "forward") + " B=" + std::to_string(p.B) + " H=" + std::to_string(p.H) +
         " Hkv=" + std::to_string(p.Hkv) + " T=" + std::to_string(p.T) + " S=" + std::to_string(p.S) +
         " D=" + std::to_string(p.D) + (p.causal ? " causal " : " full ") + dtype_name(p.dtype) + " cuda:" +
         std::to_string(p.device);
}

// What cuDNN's SDPA engines take (checked before any plan is built; the plan build has the last word).
bool problem_ok(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (q.dtype() != kBF16 && q.dtype() != kF16) return false;
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype() || k.shape() != v.shape()) return false;
  if (q.device().type != kCUDA || k.device() != q.device() || v.device() != q.device()) return false;
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  if (k.size(0) != B || k.size(3) != D || B <= 0 || H <= 0 || Hkv <= 0 || T <= 0 || S <= 0) return false;
  if (H % Hkv != 0) return false;
  if (D % 8 != 0 || D > 256) return false;
  if (T >= (int64_t(1) << 31) || S >= (int64_t(1) << 31)) return false;
  if (!std::isfinite(attrs.scale)) return false;
  if (attrs.causal) {
    if (T > S) return false;
    // Bottom-right alignment (the last query sees the last key) is an index shift; cuDNN's backward supports it for
    // lengths that are multiples of 64 only.
    if (T != S && (T % 64 != 0 || S % 64 != 0)) return false;
  }
  return layout_ok(q) && layout_ok(k) && layout_ok(v);
}

cudnnDataType_t cudnn_dtype(DType dt) { return dt == kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

// The value masked scores take. cuDNN before 9.1 wanted the lowest finite float in the forward.
float forward_mask_value() {
  return api().version >= 91000 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::lowest();
}
float backward_mask_value() { return std::numeric_limits<float>::lowest(); }

// [B, H, T, S] scores and [B, H, T, 1] row statistics, packed.
Dims score_dims(const Problem& p) { return {p.B, p.H, p.T, p.S}; }
Dims score_strides(const Problem& p) { return {p.H * p.T * p.S, p.T * p.S, p.S, 1}; }
Dims row_dims(const Problem& p) { return {p.B, p.H, p.T, 1}; }
Dims row_strides(const Problem& p) { return {p.H * p.T, p.T, 1, 1}; }

// The mask of the scores `scores` (causal: query row r keeps key c when r + S - T >= c), applied with BINARY_SELECT.
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Problem& p, cudnnBackendDescriptor_t scores) {
  const Dims sd = score_dims(p), ss = score_strides(p);
  cudnnBackendDescriptor_t row = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, row, 2);
  if (p.T != p.S) {
    cudnnBackendDescriptor_t skv = g.scalar(kUidSkv, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t plus = g.virt(CUDNN_DATA_INT32, sd, ss);
    g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row, skv, nullptr, plus);
    cudnnBackendDescriptor_t sq = g.scalar(kUidSq, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t shifted = g.virt(CUDNN_DATA_INT32, sd, ss);
    g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, plus, sq, nullptr, shifted);
    row = shifted;
  }
  cudnnBackendDescriptor_t col = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, col, 3);
  cudnnBackendDescriptor_t keep = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  cudnnBackendDescriptor_t value = g.scalar(kUidMaskValue, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t masked = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, value, keep, masked);
  return masked;
}

// K [B, Hkv, S, D] as the [B, Hkv, D, S] operand of Q K^T (the same memory, strides swapped).
Dims transposed(const Dims& d) { return {d[0], d[1], d[3], d[2]}; }

void build_forward(GraphBuilder& g, const Problem& p, const Dims& qs, const Dims& ks, const Dims& vs,
                   const Dims& os) {
  const cudnnDataType_t dt = cudnn_dtype(p.dtype);
  const Dims sd = score_dims(p), ss = score_strides(p), rd = row_dims(p), rs = row_strides(p);
  cudnnBackendDescriptor_t q = g.tensor(kUidQ, dt, {p.B, p.H, p.T, p.D}, qs, false);
  cudnnBackendDescriptor_t kt = g.tensor(kUidK, dt, {p.B, p.Hkv, p.D, p.S}, transposed(ks), false);
  cudnnBackendDescriptor_t v = g.tensor(kUidV, dt, {p.B, p.Hkv, p.S, p.D}, vs, false);
  cudnnBackendDescriptor_t o = g.tensor(kUidO, dt, {p.B, p.H, p.T, p.D}, os, false);
  cudnnBackendDescriptor_t stats = g.tensor(kUidStats, CUDNN_DATA_FLOAT, rd, rs, false);
  cudnnBackendDescriptor_t scale = g.scalar(kUidScale, CUDNN_DATA_FLOAT);

  cudnnBackendDescriptor_t s = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(q, kt, s);
  cudnnBackendDescriptor_t scaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, scale, nullptr, scaled);
  cudnnBackendDescriptor_t last = p.causal ? causal_mask(g, p, scaled) : scaled;

  cudnnBackendDescriptor_t row_max = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, last, row_max);
  cudnnBackendDescriptor_t centered = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, last, row_max, nullptr, centered);
  cudnnBackendDescriptor_t e = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centered, nullptr, nullptr, e);
  cudnnBackendDescriptor_t row_sum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  cudnnBackendDescriptor_t log_sum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, row_max, log_sum, nullptr, stats);
  // The probabilities in the input dtype: the second matmul's A operand.
  cudnnBackendDescriptor_t probs = g.virt(dt, sd, ss);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, row_sum, nullptr, probs);
  g.matmul(probs, v, o);
}

void build_backward(GraphBuilder& g, const Problem& p, const Dims& qs, const Dims& ks, const Dims& vs,
                    const Dims& os, const Dims& dos, const Dims& dqs, const Dims& dks, const Dims& dvs) {
  const cudnnDataType_t dt = cudnn_dtype(p.dtype);
  const Dims sd = score_dims(p), ss = score_strides(p), rd = row_dims(p), rs = row_strides(p);
  const Dims qd{p.B, p.H, p.T, p.D}, kd{p.B, p.Hkv, p.S, p.D};
  const Dims q_packed{p.H * p.T * p.D, p.T * p.D, p.D, 1};
  // The scores transposed ([B, H, S, T] views of the packed [B, H, T, S]).
  const Dims td{p.B, p.H, p.S, p.T}, ts{p.H * p.T * p.S, p.T * p.S, 1, p.S};
  const Dims per_query_head_kv{p.B, p.H, p.S, p.D}, per_query_head_kv_strides{p.H * p.S * p.D, p.S * p.D, p.D, 1};

  cudnnBackendDescriptor_t q = g.tensor(kUidQ, dt, qd, qs, false);
  cudnnBackendDescriptor_t kt = g.tensor(kUidK, dt, transposed(kd), transposed(ks), false);
  cudnnBackendDescriptor_t vt = g.tensor(kUidV, dt, transposed(kd), transposed(vs), false);
  cudnnBackendDescriptor_t o = g.tensor(kUidO, dt, qd, os, false);
  cudnnBackendDescriptor_t stats = g.tensor(kUidStats, CUDNN_DATA_FLOAT, rd, rs, false);
  cudnnBackendDescriptor_t d_o = g.tensor(kUidDO, dt, qd, dos, false);
  cudnnBackendDescriptor_t dq = g.tensor(kUidDQ, dt, qd, dqs, false);
  cudnnBackendDescriptor_t dk = g.tensor(kUidDK, dt, kd, dks, false);
  cudnnBackendDescriptor_t dv = g.tensor(kUidDV, dt, kd, dvs, false);
  cudnnBackendDescriptor_t scale = g.scalar(kUidScale, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t one = g.scalar(kUidOne, CUDNN_DATA_FLOAT);

  // Dsum = rowsum(dO * O) (times the dropout keep probability, 1 here).
  cudnnBackendDescriptor_t do_o = g.virt(CUDNN_DATA_FLOAT, qd, q_packed);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, nullptr, do_o);
  cudnnBackendDescriptor_t do_o_sum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, do_o_sum);
  cudnnBackendDescriptor_t dsum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, do_o_sum, one, nullptr, dsum);

  // P = exp(scale * Q K^T (masked) - Stats).
  cudnnBackendDescriptor_t s = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(q, kt, s);
  cudnnBackendDescriptor_t scaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, scale, nullptr, scaled);
  cudnnBackendDescriptor_t last = p.causal ? causal_mask(g, p, scaled) : scaled;
  cudnnBackendDescriptor_t centered = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, last, stats, nullptr, centered);
  cudnnBackendDescriptor_t probs = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centered, nullptr, nullptr, probs);

  // a @ b into a kv-head gradient: per query head, then summed over the query heads of each kv head (GQA).
  auto matmul_into_kv_heads = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                  cudnnBackendDescriptor_t kv_grad) {
    if (p.H == p.Hkv) {
      g.matmul(a, b, kv_grad);
      return;
    }
    cudnnBackendDescriptor_t per_head = g.virt(dt, per_query_head_kv, per_query_head_kv_strides);
    g.matmul(a, b, per_head);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, per_head, kv_grad);
  };

  // dV = P^T dO.
  cudnnBackendDescriptor_t probs_t = g.virt(dt, td, ts);
  g.reshape(probs, probs_t);
  matmul_into_kv_heads(probs_t, d_o, dv);

  // dS = scale * P * (dO V^T - Dsum).
  cudnnBackendDescriptor_t dp = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(d_o, vt, dp);
  cudnnBackendDescriptor_t dp_kept = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp, one, nullptr, dp_kept);
  cudnnBackendDescriptor_t dp_centered = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp_kept, dsum, nullptr, dp_centered);
  cudnnBackendDescriptor_t ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centered, probs, nullptr, ds_unscaled);
  cudnnBackendDescriptor_t ds = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, scale, nullptr, ds);

  // dK = dS^T Q.
  cudnnBackendDescriptor_t ds_t = g.virt(dt, td, ts);
  g.reshape(ds, ds_t);
  matmul_into_kv_heads(ds_t, q, dk);

  // dQ = dS K, accumulated in f32 (a zeroed buffer in cuDNN's F16x16 order), then converted.
  cudnnBackendDescriptor_t k_again = g.virt(CUDNN_DATA_FLOAT, kd, ks);
  g.reshape(kt, k_again);
  cudnnBackendDescriptor_t dq_accum = g.tensor(kUidDQAccum, CUDNN_DATA_FLOAT, qd, q_packed, false, false, true);
  g.matmul(ds, k_again, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq);
}

std::mutex cache_mu;
std::map<std::vector<int64_t>, std::shared_ptr<const Plan>> cache;

void append(std::vector<int64_t>& key, const Dims& d) { key.insert(key.end(), d.begin(), d.end()); }

// The cached plan for the key, built on first use (with the device current and its handle locked). Never throws:
// a failure is a plan with ok == false.
template <typename Build>
std::shared_ptr<const Plan> plan_for(const std::vector<int64_t>& key, const Problem& p, bool backward, Build build) {
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto plan = std::make_shared<Plan>();
  plan->causal = p.causal;
  plan->bottom_right = p.causal && p.T != p.S;
  if (backward) plan->dq_accum_elements = p.B * p.H * p.T * p.D;
  const std::string what = describe(p, backward);
  HandleSlot* slot = handle_slot(p.device);
  if (slot == nullptr || slot->handle == nullptr) {
    plan->failure = "no cuDNN handle for " + what + (slot != nullptr ? ": " + slot->error : "");
  } else {
    try {
      cuda::DeviceGuard guard(p.device);
      std::lock_guard<std::mutex> handle_lock(slot->mu);
      GraphBuilder g(what);
      build(g);
      g.build(slot->handle, *plan);
    } catch (const std::exception& e) {
      plan->ok = false;
      plan->keep.clear();
      plan->plan = nullptr;
      plan->failure = e.what();
    }
  }
  if (!plan->ok) note_failure(plan->failure);
  std::lock_guard<std::mutex> lock(cache_mu);
  auto [it, inserted] = cache.emplace(key, std::move(plan));
  return it->second;  // a concurrent build of the same key: the first one stored wins
}

std::shared_ptr<const Plan> forward_plan(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const AttentionAttrs& attrs, const Tensor& out) {
  const Problem p = problem_of(q, k, attrs);
  const Dims qs = strides_of(q), ks = strides_of(k), vs = strides_of(v), os = strides_of(out);
  std::vector<int64_t> key{0, p.device, int64_t(p.dtype), p.B, p.H, p.Hkv, p.T, p.S, p.D, int64_t(p.causal)};
  for (const Dims* d : {&qs, &ks, &vs, &os}) append(key, *d);
  return plan_for(key, p, false, [&](GraphBuilder& g) { build_forward(g, p, qs, ks, vs, os); });
}

std::shared_ptr<const Plan> backward_plan(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const AttentionAttrs& attrs, const Tensor& grad_q,
                                          const Tensor& grad_k, const Tensor& grad_v) {
  const Problem p = problem_of(q, k, attrs);
  const Dims qs = strides_of(q), ks = strides_of(k), vs = strides_of(v), os = strides_of(out),
             dos = strides_of(grad_out), dqs = strides_of(grad_q), dks = strides_of(grad_k),
             dvs = strides_of(grad_v);
  std::vector<int64_t> key{1, p.device, int64_t(p.dtype), p.B, p.H, p.Hkv, p.T, p.S, p.D, int64_t(p.causal)};
  for (const Dims* d : {&qs, &ks, &vs, &os, &dos, &dqs, &dks, &dvs}) append(key, *d);
  return plan_for(key, p, true,
                  [&](GraphBuilder& g) { build_backward(g, p, qs, ks, vs, os, dos, dqs, dks, dvs); });
}

// ---------------------------------------------------------------------------------------------------------------
// Execution.

struct Binding {
  std::vector<int64_t> uids;
  std::vector<void*> pointers;
  void add(int64_t uid, const void* pointer) {
    uids.push_back(uid);
    pointers.push_back(const_cast<void*>(pointer));
  }
};

void execute(const Plan& plan, const Problem& p, bool backward, cudaStream_t stream, Binding& binding) {
  const std::string what = describe(p, backward);
  LOOM_CHECK(plan.ok && plan.plan != nullptr, "cudnn attention: no plan for ", what, ": ", plan.failure);
  HandleSlot* slot = handle_slot(p.device);
  LOOM_CHECK(slot != nullptr && slot->handle != nullptr, "cudnn attention: no handle for ", what);
  // Scratch from Loom's caching allocator, freed at scope exit: reused only on this stream, after this call.
  Tensor workspace;
  if (plan.workspace_bytes > 0) workspace = empty({plan.workspace_bytes}, kU8, Device(kCUDA, p.device));
  void* workspace_ptr = workspace.defined() ? workspace.data() : nullptr;
  if (const int fill = workspace_fill.load(); fill >= 0 && workspace_ptr != nullptr)
    LOOM_CUDA_CHECK(cudaMemsetAsync(workspace_ptr, fill, size_t(plan.workspace_bytes), stream));
  try {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, what);
    check(api().set_attribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                              int64_t(binding.uids.size()), binding.uids.data()),
          "cudnnBackendSetAttribute(variant pack uids)", what);
    check(api().set_attribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                              int64_t(binding.pointers.size()), binding.pointers.data()),
          "cudnnBackendSetAttribute(variant pack data pointers)", what);
    check(api().set_attribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace_ptr),
          "cudnnBackendSetAttribute(variant pack workspace)", what);
    check(api().finalize(pack.get()), "cudnnBackendFinalize(variant pack)", what);
    std::lock_guard<std::mutex> lock(slot->mu);
    check(api().set_stream(slot->handle, stream), "cudnnSetStream", what);
    check(api().execute(slot->handle, plan.plan, pack.get()), "cudnnBackendExecute", what);
  } catch (const CudnnFailure& e) {
    LOOM_THROW("scaled_dot_product_attention (cudnn): ", e.what());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels and predicates.

bool lse_ok(const Tensor& lse, const Tensor& q) {
  return lse.defined() && lse.dtype() == kF32 && lse.is_contiguous() && lse.device() == q.device() &&
         lse.numel() == q.size(0) * q.size(1) * q.size(2) && aligned16(lse);
}

// One predicate for the plain and the strided op: the plain op's contiguous tensors are one case of the views.
bool forward_supports(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs, Tensor& out,
                      Tensor& lse) {
  if (!api().ok) return false;
  if (!problem_ok(q, k, v, attrs) || !like(out, q) || !lse_ok(lse, q)) return false;
  return forward_plan(q, k, v, attrs, out)->ok;
}

// What both directions pass: q, k, v, out, lse, and the run-time scalars (scale, the mask value, the causal offset's
// lengths), which must live until execute() returns.
struct CommonArgs {
  float scale, mask_value;
  int32_t skv, sq;
};

void bind_common(Binding& b, const Plan& plan, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                 const Tensor& lse, CommonArgs& args) {
  b.add(kUidQ, q.data());
  b.add(kUidK, k.data());
  b.add(kUidV, v.data());
  b.add(kUidO, out.data());
  b.add(kUidStats, lse.data());
  b.add(kUidScale, &args.scale);
  if (plan.causal) b.add(kUidMaskValue, &args.mask_value);
  if (plan.bottom_right) {
    b.add(kUidSkv, &args.skv);
    b.add(kUidSq, &args.sq);
  }
}

void cudnn_forward(const DeviceContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                   const AttentionAttrs& attrs, Tensor& out, Tensor& lse) {
  const Problem p = problem_of(q, k, attrs);
  cuda::DeviceGuard guard(ctx.device().index);
  const std::shared_ptr<const Plan> plan = forward_plan(q, k, v, attrs, out);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  CommonArgs args{float(attrs.scale), forward_mask_value(), int32_t(p.S), int32_t(p.T)};
  Binding b;
  bind_common(b, *plan, q, k, v, out, lse, args);
  // What cuDNN writes (vendor_writes.h): outputs it never reads, so marked before the call too.
  auto mark_written = [&] {
    cuda::mark_vendor_written(out, stream);
    cuda::mark_vendor_written(lse, stream);
  };
  mark_written();
  execute(*plan, p, false, stream, b);
  mark_written();
}

bool backward_supports(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                       const Tensor& lse, const AttentionAttrs& attrs, Tensor& grad_q, Tensor& grad_k,
                       Tensor& grad_v) {
  if (!api().ok) return false;
  if (!problem_ok(q, k, v, attrs) || !like(out, q) || !like(grad_out, q) || !lse_ok(lse, q)) return false;
  // cuDNN writes all three gradients: a call that needs only some is left to the native kernels.
  if (!like(grad_q, q) || !like(grad_k, k) || !like(grad_v, v)) return false;
  return backward_plan(grad_out, q, k, v, out, attrs, grad_q, grad_k, grad_v)->ok;
}

void cudnn_backward(const DeviceContext& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                    Tensor& grad_q, Tensor& grad_k, Tensor& grad_v) {
  const Problem p = problem_of(q, k, attrs);
  cuda::DeviceGuard guard(ctx.device().index);
  const std::shared_ptr<const Plan> plan = backward_plan(grad_out, q, k, v, out, attrs, grad_q, grad_k, grad_v);
  cudaStream_t stream = cuda_context(ctx).cuda_stream();
  // The dQ accumulator, zeroed on the call's stream (freed at scope exit, after the work queued here).
  Tensor dq_accum = empty({plan->dq_accum_elements}, kF32, ctx.device());
  LOOM_CUDA_CHECK(cudaMemsetAsync(dq_accum.data(), 0, dq_accum.nbytes(), stream));
  CommonArgs args{float(attrs.scale), backward_mask_value(), int32_t(p.S), int32_t(p.T)};
  float one = 1.0f;
  Binding b;
  bind_common(b, *plan, q, k, v, out, lse, args);
  b.add(kUidDO, grad_out.data());
  b.add(kUidDQ, grad_q.data());
  b.add(kUidDK, grad_k.data());
  b.add(kUidDV, grad_v.data());
  b.add(kUidDQAccum, dq_accum.data());
  b.add(kUidOne, &one);
  for (const Tensor* g : {&grad_q, &grad_k, &grad_v}) cuda::mark_vendor_written(*g, stream);  // before, as forward
  execute(*plan, p, true, stream, b);
  for (const Tensor* g : {&grad_q, &grad_k, &grad_v}) cuda::mark_vendor_written(*g, stream);
}

}  // namespace

bool available() { return api().ok; }
size_t version() { return api().version; }
size_t cached_plans() {
  std::lock_guard<std::mutex> lock(cache_mu);
  return cache.size();
}

// Above the native flash kernels (priority 10): cuDNN serves what it supports, flash (then the simple kernel) the rest.
constexpr int kCudnnPriority = 20;

LOOM_REGISTER_KERNEL(scaled_dot_product_attention, kCUDA, "cudnn", dtypes(kF16, kBF16), cudnn_forward, kCudnnPriority,
                     forward_supports, __FILE__);
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_strided, kCUDA, "cudnn", dtypes(kF16, kBF16), cudnn_forward,
                     kCudnnPriority, forward_supports, __FILE__);
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward, kCUDA, "cudnn", dtypes(kF16, kBF16), cudnn_backward,
                     kCudnnPriority, backward_supports, __FILE__);
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward_strided, kCUDA, "cudnn", dtypes(kF16, kBF16),
                     cudnn_backward, kCudnnPriority, backward_supports, __FILE__);

}  // namespace loom::cuda::cudnn_attention

#endif  // LOOM_HAVE_CUDNN_HEADER
