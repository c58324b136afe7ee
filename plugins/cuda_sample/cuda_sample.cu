// A sample CUDA kernel library for Loom, written only against loom/abi/loom_kernel_abi.h (no Loom C++ header, no
// link to Loom): the CUDA runtime, plain cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx, not cuBLASLt) and one
// small kernel file.
//   gemm  f32 (TF32 only when Loom asks), bf16 and f16 (f32 compute, output in the input dtype or widened to f32),
//         strided batch, the bias epilogue as a separate kernel; it declines the GELU epilogues and f64 compute
//         through supports(), so Loom falls back to its own kernel for those.
//   add   f32 and bf16, any strides (broadcast inputs have stride 0), out may alias an input.
// Every launch goes to the stream Loom hands out (host->get_stream); cuBLAS scratch comes from Loom's allocator.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include <climits>
#include <cstdio>
#include <mutex>

#include "loom_kernel_abi.h"

namespace {

const LoomHost* host = nullptr;
thread_local char last_error_message[512];

int fail(int status, const char* what, const char* detail = "") {
  std::snprintf(last_error_message, sizeof last_error_message, "cuda_sample: %s%s%s", what, *detail ? ": " : "",
                detail);
  return status;
}

const char* sample_last_error(void*) { return last_error_message; }

cudaStream_t stream_of(int32_t device_index) {
  return static_cast<cudaStream_t>(host->get_stream(host->host_ctx, LOOM_DEVICE_CUDA, device_index));
}

// Makes a device current for a call and puts the caller's device back.
class DeviceScope {
 public:
  explicit DeviceScope(int index) {
    cudaGetDevice(&previous_);
    if (previous_ != index) cudaSetDevice(index);
  }
  ~DeviceScope() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

// ---- cuBLAS: one handle per device, and one workspace per (device, stream) from Loom's allocator. ----

constexpr int kMaxDevices = 64;
constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kMaxWorkspaces = 64;

struct Workspace {
  int device = -1;
  cudaStream_t stream = nullptr;
  void* ptr = nullptr;
};

struct Blas {
  std::mutex mu;  // a handle is bound to one stream and workspace at a time: held from cublasSetStream to enqueue
  cublasHandle_t handles[kMaxDevices] = {};
  Workspace workspaces[kMaxWorkspaces];
  int n_workspaces = 0;
};
Blas& blas() {
  static Blas* b = new Blas;  // never destroyed: Loom may still call in during static teardown
  return *b;
}

// Tells compute-sanitizer's initcheck that cuBLAS wrote [data, data + bytes) on `stream`: the tool does not see the
// bulk (TMA) stores of cuBLAS's Hopper kernels, so every later read of the product would be reported. A no-op
// without a tool attached.
void mark_written_by_cublas(const void* data, size_t bytes, cudaStream_t stream) {
  static nvtxDomainHandle_t domain = nvtxDomainCreateA("cuda_sample");
  if (!data || bytes == 0) return;
  nvtxMemVirtualRangeDesc_t range{};
  range.ptr = data;
  range.size = bytes;
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
}

// Under blas().mu. A workspace is kept for the stream's life (the ABI allows keeping it across calls).
void* workspace_locked(Blas& b, int device, cudaStream_t stream) {
  for (int i = 0; i < b.n_workspaces; ++i)
    if (b.workspaces[i].device == device && b.workspaces[i].stream == stream) return b.workspaces[i].ptr;
  if (b.n_workspaces == kMaxWorkspaces) return nullptr;  // cuBLAS then runs without a workspace
  void* p = host->allocate_workspace(host->host_ctx, LOOM_DEVICE_CUDA, device, kWorkspaceBytes);
  if (p) b.workspaces[b.n_workspaces++] = {device, stream, p};
  mark_written_by_cublas(p, kWorkspaceBytes, stream);  // cuBLAS's own partial sums (split-K) live there
  return p;
}

const char* cublas_message(cublasStatus_t s) { return cublasGetStatusString(s); }

cudaDataType_t cuda_type(int32_t dtype) {
  switch (dtype) {
    case LOOM_DTYPE_BF16: return CUDA_R_16BF;
    case LOOM_DTYPE_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// ---- Kernels. ----

template <typename T>
__device__ float to_float(T v) {
  return float(v);
}
template <>
__device__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ float to_float(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ T from_float(float v) {
  return T(v);
}
template <>
__device__ __nv_bfloat16 from_float(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __half from_float(float v) {
  return __float2half_rn(v);
}

// C[b, :, :] (column-major, m x n, leading dim ldc) gets bias[i] added to row i; or, when scale_only, C = beta * C
// (the whole product when k == 0; beta == 0 never reads C, which may hold NaN).
template <typename T>
__global__ void bias_or_scale_kernel(T* c, int64_t ldc, int64_t stride_c, int64_t m, int64_t n, int64_t total,
                                     const T* bias, bool scale_only, float beta) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t i = idx % m, j = (idx / m) % n, b = idx / (m * n);
    T* p = c + b * stride_c + j * ldc + i;
    float v = scale_only ? (beta == 0.0f ? 0.0f : beta * to_float(*p)) : to_float(*p);
    if (bias) v += to_float(bias[i]);
    *p = from_float<T>(v);
  }
}

struct StridedShape {
  int rank;
  int64_t shape[LOOM_MAX_DIMS];
  int64_t a[LOOM_MAX_DIMS], b[LOOM_MAX_DIMS], out[LOOM_MAX_DIMS];
};

// out = a + b over out's shape; each element is read before it is written, so out may alias an input.
template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, StridedShape s, int64_t total) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = idx, oa = 0, ob = 0, oo = 0;
    for (int d = s.rank - 1; d >= 0; --d) {
      int64_t i = rest % s.shape[d];
      rest /= s.shape[d];
      oa += i * s.a[d], ob += i * s.b[d], oo += i * s.out[d];
    }
    out[oo] = from_float<T>(to_float(a[oa]) + to_float(b[ob]));
  }
}

unsigned grid_for(int64_t total) {
  int64_t blocks = (total + 255) / 256;
  return unsigned(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

int check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? LOOM_STATUS_OK : fail(LOOM_STATUS_ERROR, what, cudaGetErrorString(e));
}

// ---- gemm ----

struct GemmArgs {
  int trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  double alpha, beta;
  int64_t compute, epilogue;
};

GemmArgs read_gemm(const LoomAttr* attrs, int n) {
  GemmArgs g;
  g.trans_a = int(loom_attr_int(attrs, n, "trans_a", 0));
  g.trans_b = int(loom_attr_int(attrs, n, "trans_b", 0));
  g.m = loom_attr_int(attrs, n, "m", 0), g.n = loom_attr_int(attrs, n, "n", 0), g.k = loom_attr_int(attrs, n, "k", 0);
  g.lda = loom_attr_int(attrs, n, "lda", 0), g.ldb = loom_attr_int(attrs, n, "ldb", 0);
  g.ldc = loom_attr_int(attrs, n, "ldc", 0), g.batch = loom_attr_int(attrs, n, "batch", 1);
  g.stride_a = loom_attr_int(attrs, n, "stride_a", 0), g.stride_b = loom_attr_int(attrs, n, "stride_b", 0);
  g.stride_c = loom_attr_int(attrs, n, "stride_c", 0);
  g.alpha = loom_attr_float(attrs, n, "alpha", 1.0), g.beta = loom_attr_float(attrs, n, "beta", 0.0);
  g.compute = loom_attr_int(attrs, n, "compute", 0), g.epilogue = loom_attr_int(attrs, n, "epilogue", 0);
  return g;
}

bool fits_int(const GemmArgs& g) {
  for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.batch})
    if (v > INT_MAX) return false;
  return true;
}

int sample_gemm_supports(void*, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                         const LoomAttr* attrs, int n_attrs) {
  if (n_in != 3 || n_out != 2 || in[0].device_type != LOOM_DEVICE_CUDA) return 0;
  GemmArgs g = read_gemm(attrs, n_attrs);
  const int32_t a = in[0].dtype, c = out[0].dtype;
  bool same = a == c && (a == LOOM_DTYPE_F32 || a == LOOM_DTYPE_BF16 || a == LOOM_DTYPE_F16);
  bool widening = (a == LOOM_DTYPE_BF16 || a == LOOM_DTYPE_F16) && c == LOOM_DTYPE_F32;
  // No GELU epilogue (2, 3) and no f64 compute: Loom's own kernel takes those.
  return (same || widening) && (g.epilogue == 0 || g.epilogue == 1) && g.compute != 2 && fits_int(g);
}

template <typename T>
void launch_bias_or_scale(const GemmArgs& g, void* c, const void* bias, bool scale_only, cudaStream_t stream) {
  int64_t total = g.m * g.n * g.batch;
  bias_or_scale_kernel<T><<<grid_for(total), 256, 0, stream>>>(static_cast<T*>(c), g.ldc, g.stride_c, g.m, g.n, total,
                                                               static_cast<const T*>(bias), scale_only,
                                                               float(g.beta));
}

int bias_or_scale(const GemmArgs& g, int32_t dtype, void* c, const void* bias, bool scale_only, cudaStream_t stream) {
  switch (dtype) {
    case LOOM_DTYPE_F32: launch_bias_or_scale<float>(g, c, bias, scale_only, stream); break;
    case LOOM_DTYPE_BF16: launch_bias_or_scale<__nv_bfloat16>(g, c, bias, scale_only, stream); break;
    case LOOM_DTYPE_F16: launch_bias_or_scale<__half>(g, c, bias, scale_only, stream); break;
    default: return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm", "unsupported output dtype");
  }
  return check_launch("gemm epilogue");
}

int sample_gemm(void*, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                const LoomAttr* attrs, int n_attrs) {
  if (!sample_gemm_supports(nullptr, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm", "a call supports() declines");
  const GemmArgs g = read_gemm(attrs, n_attrs);
  const void* bias = g.epilogue == 1 ? in[2].data : nullptr;
  if (g.epilogue == 1 && !bias) return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm", "bias epilogue without a bias");
  if (g.m == 0 || g.n == 0 || g.batch == 0) return LOOM_STATUS_OK;

  const int device = out[0].device_index;
  DeviceScope scope(device);
  cudaStream_t stream = stream_of(device);
  const int32_t out_dtype = out[0].dtype;
  if (g.k == 0) return bias_or_scale(g, out_dtype, out[0].data, bias, /*scale_only=*/true, stream);

  const float alpha = float(g.alpha), beta = float(g.beta);
  cublasComputeType_t compute = in[0].dtype == LOOM_DTYPE_F32 && g.compute == 1 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                                 : CUBLAS_COMPUTE_32F;
  cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cudaDataType_t ab = cuda_type(in[0].dtype), c = cuda_type(out_dtype);
  {
    Blas& b = blas();
    std::lock_guard<std::mutex> lock(b.mu);
    if (device < 0 || device >= kMaxDevices) return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm", "device index");
    cublasHandle_t& h = b.handles[device];
    if (!h) {
      cublasStatus_t s = cublasCreate(&h);
      if (s != CUBLAS_STATUS_SUCCESS) {
        h = nullptr;
        return fail(LOOM_STATUS_ERROR, "cublasCreate", cublas_message(s));
      }
    }
    cublasStatus_t s = cublasSetStream(h, stream);
    if (void* ws = workspace_locked(b, device, stream); s == CUBLAS_STATUS_SUCCESS && ws)
      s = cublasSetWorkspace(h, ws, kWorkspaceBytes);
    if (s == CUBLAS_STATUS_SUCCESS) {
      if (g.batch == 1)
        s = cublasGemmEx(h, op_a, op_b, int(g.m), int(g.n), int(g.k), &alpha, in[0].data, ab, int(g.lda),
                         in[1].data, ab, int(g.ldb), &beta, out[0].data, c, int(g.ldc), compute, CUBLAS_GEMM_DEFAULT);
      else
        s = cublasGemmStridedBatchedEx(h, op_a, op_b, int(g.m), int(g.n), int(g.k), &alpha, in[0].data, ab,
                                       int(g.lda), g.stride_a, in[1].data, ab, int(g.ldb), g.stride_b, &beta,
                                       out[0].data, c, int(g.ldc), g.stride_c, int(g.batch), compute,
                                       CUBLAS_GEMM_DEFAULT);
    }
    if (s != CUBLAS_STATUS_SUCCESS) return fail(LOOM_STATUS_ERROR, "cuBLAS gemm", cublas_message(s));
  }
  const size_t c_bytes = out_dtype == LOOM_DTYPE_F32 ? 4 : 2;
  if (g.m > 0 && g.n > 0 && g.batch > 0)
    mark_written_by_cublas(out[0].data, size_t((g.batch - 1) * g.stride_c + (g.n - 1) * g.ldc + g.m) * c_bytes,
                           stream);
  if (bias) return bias_or_scale(g, out_dtype, out[0].data, bias, /*scale_only=*/false, stream);
  return LOOM_STATUS_OK;
}

// ---- add ----

int sample_add_supports(void*, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                        const LoomAttr*, int) {
  return n_in == 2 && n_out == 1 && in[0].dtype == out[0].dtype && in[1].dtype == out[0].dtype &&
         in[0].rank == out[0].rank && in[1].rank == out[0].rank && out[0].device_type == LOOM_DEVICE_CUDA;
}

int sample_add(void*, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out, const LoomAttr* attrs,
               int n_attrs) {
  if (!sample_add_supports(nullptr, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "add", "inputs must have the output's dtype and rank");
  const LoomTensorDesc& o = out[0];
  const int64_t total = loom_desc_numel(&o);
  if (total == 0) return LOOM_STATUS_OK;
  StridedShape s;
  s.rank = o.rank;
  for (int d = 0; d < o.rank; ++d)
    s.shape[d] = o.shape[d], s.a[d] = in[0].strides[d], s.b[d] = in[1].strides[d], s.out[d] = o.strides[d];
  DeviceScope scope(o.device_index);
  cudaStream_t stream = stream_of(o.device_index);
  if (o.dtype == LOOM_DTYPE_F32)
    add_kernel<float><<<grid_for(total), 256, 0, stream>>>(static_cast<const float*>(in[0].data),
                                                          static_cast<const float*>(in[1].data),
                                                          static_cast<float*>(o.data), s, total);
  else if (o.dtype == LOOM_DTYPE_BF16)
    add_kernel<__nv_bfloat16><<<grid_for(total), 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(in[0].data), static_cast<const __nv_bfloat16*>(in[1].data),
        static_cast<__nv_bfloat16*>(o.data), s, total);
  else
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "add", "unsupported dtype");
  return check_launch("add");
}

void sample_shutdown(void*) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.mu);
  for (int d = 0; d < kMaxDevices; ++d)
    if (b.handles[d]) {
      DeviceScope scope(d);
      cublasDestroy(b.handles[d]);
      b.handles[d] = nullptr;
    }
  for (int i = 0; i < b.n_workspaces; ++i)
    host->free_workspace(host->host_ctx, LOOM_DEVICE_CUDA, b.workspaces[i].device, b.workspaces[i].ptr);
  b.n_workspaces = 0;
}

const LoomOpEntry sample_ops[] = {
    {sizeof(LoomOpEntry), LOOM_DEVICE_CUDA, "gemm",
     LOOM_DTYPE_BIT(LOOM_DTYPE_F32) | LOOM_DTYPE_BIT(LOOM_DTYPE_BF16) | LOOM_DTYPE_BIT(LOOM_DTYPE_F16), 0, sample_gemm,
     sample_gemm_supports, {nullptr}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CUDA, "add", LOOM_DTYPE_BIT(LOOM_DTYPE_F32) | LOOM_DTYPE_BIT(LOOM_DTYPE_BF16), 0,
     sample_add, sample_add_supports, {nullptr}},
};

}  // namespace

LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* h, LoomProvider* p) {
  // The version first: Loom checks it even when init fails.
  p->abi_major = LOOM_ABI_VERSION_MAJOR;
  p->abi_minor = LOOM_ABI_VERSION_MINOR;
  p->last_error = sample_last_error;
  if (h->struct_size < offsetof(LoomHost, reserved) || h->abi_major != LOOM_ABI_VERSION_MAJOR || !h->get_stream ||
      !h->allocate_workspace || !h->free_workspace)
    return fail(LOOM_STATUS_UNSUPPORTED, "init", "the host table does not match this library's ABI");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for Loom's own CUDA calls
    return fail(LOOM_STATUS_UNSUPPORTED, "init", "no CUDA device is visible");
  }
  host = h;
  p->name = "cuda_sample";
  p->version = "0.1";
  p->ctx = nullptr;
  p->ops = sample_ops;
  p->n_ops = int32_t(sizeof sample_ops / sizeof sample_ops[0]);
  p->shutdown = sample_shutdown;
  if (h->log) h->log(h->host_ctx, LOOM_LOG_DEBUG, "cuda_sample initialized");
  return LOOM_STATUS_OK;
}
