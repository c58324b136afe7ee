// CUDA gemm through cuBLASLt: f32 (TF32 only when GemmParams asks for it), bf16 and f16 with f32 compute, f64;
// strided batch; bias, GELU and bias+GELU epilogues, the bias gradient of B (BGRADB: a linear layer's bias gradient
// from its weight gradient's product) and the GELU derivative (DGELU, the MLP's backward), fused into the matmul where
// cuBLASLt offers them.
//
// Descriptors, layouts and the heuristic's algorithm are cached per problem (shapes, layouts, dtypes, epilogue and
// pointer alignments). Where cuBLASLt has no fused epilogue for a problem (f64, an aux buffer whose leading dimension is
// not a multiple of 8, a misaligned bias) the matmul runs plain and a small kernel applies the epilogue (from an f32
// product for a 16-bit C, which is then rounded once, as the fused epilogue does); where it has no algorithm at all,
// legacy cuBLAS runs the product.
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/cublaslt_util.h"
#include "kernels/column_sums_kernel.h"
#include "backends/cuda/vendor_writes.h"
#include "kernels/gemm_kernel.h"
#include "kernels/primitives/gelu.h"

namespace loom {
namespace {

cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF64: return CUDA_R_64F;
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    default: LOOM_THROW("gemm (cuda): dtype ", dtype_name(t), " is not supported");
  }
}

cublasComputeType_t compute_type(const GemmParams& p) {
  if (p.input_dtype == kF64) return CUBLAS_COMPUTE_64F;
  if (p.input_dtype == kF32 && p.compute == ComputeType::kTF32) return CUBLAS_COMPUTE_32F_FAST_TF32;
  return CUBLAS_COMPUTE_32F;
}

struct PlanKey {
  int device;
  DType input, output;
  cublasComputeType_t compute;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  cublasLtEpilogue_t epilogue;
  int align_a, align_b, align_c, align_aux;

  auto fields() const {
    return std::tie(device, input, output, compute, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch, stride_a,
                    stride_b, stride_c, epilogue, align_a, align_b, align_c, align_aux);
  }
  bool operator==(const PlanKey& o) const { return fields() == o.fields(); }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 1469598103934665603ull;
    std::apply([&h](const auto&... f) { ((h = (h ^ size_t(int64_t(f))) * 1099511628211ull), ...); }, key.fields());
    return h;
  }
};

// A cached problem: descriptors and the chosen algorithm. The pointers (bias, aux) live in the descriptor, so a call
// sets them and enqueues under `mu`.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
  std::mutex mu;

  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

class PlanCache {
 public:
  Plan& get(const PlanKey& key, const std::function<std::unique_ptr<Plan>()>& build) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return *it->second;
    }
    std::unique_ptr<Plan> plan = build();  // outside the lock: the heuristic query takes a while
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = plans_.emplace(key, std::move(plan));
    return *it->second;
  }

 private:
  std::mutex mu_;
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans_;
};

PlanCache& plan_cache() {
  static auto* cache = new PlanCache;  // never destroyed: cuBLASLt may be unloaded before static destructors run
  return *cache;
}

template <typename T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(T)));
}

cublasLtMatrixLayout_t make_layout(DType t, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, cuda_data_type(t), uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t count = int32_t(batch);
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    LOOM_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
  return l;
}

std::unique_ptr<Plan> build_plan(const CudaDeviceContext& cuda, const PlanKey& key, const GemmParams& p) {
  auto plan = std::make_unique<Plan>();
  cudaDataType_t scale = key.compute == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, key.compute, scale));
  cublasOperation_t ta = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, key.epilogue);
  if (key.epilogue & CUBLASLT_EPILOGUE_BIAS) set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  if (key.epilogue == CUBLASLT_EPILOGUE_BGRADB) {  // the bias gradient in D's dtype (f32 for a widening product)
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_grad);
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(cuda_data_type(key.output)));
  }
  if (key.epilogue == CUBLASLT_EPILOGUE_GELU_AUX || key.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
      key.epilogue == CUBLASLT_EPILOGUE_DGELU) {
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.pre_gelu);
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, key.ldc);
    set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, key.batch > 1 ? key.stride_c : int64_t(0));
  }
  plan->a = make_layout(key.input, key.trans_a ? key.k : key.m, key.trans_a ? key.m : key.k, key.lda, key.batch,
                        key.stride_a);
  plan->b = make_layout(key.input, key.trans_b ? key.n : key.k, key.trans_b ? key.k : key.n, key.ldb, key.batch,
                        key.stride_b);
  plan->c = make_layout(key.output, key.m, key.n, key.ldc, key.batch, key.stride_c);

  if (auto algo = cuda::heuristic_algorithm(cuda.cublaslt(), plan->desc, plan->a, plan->b, plan->c,
                                            cuda.workspace_bytes(), uint32_t(key.align_a), uint32_t(key.align_b),
                                            uint32_t(key.align_c))) {
    plan->algo = *algo;
    plan->has_algo = true;
  }
  return plan;
}

PlanKey make_key(const GemmParams& p, cublasLtEpilogue_t epilogue) {
  PlanKey key{};
  key.device = p.device.index;
  key.input = p.input_dtype;
  key.output = p.output_dtype;
  key.compute = compute_type(p);
  key.trans_a = p.trans_a;
  key.trans_b = p.trans_b;
  key.m = p.m, key.n = p.n, key.k = p.k;
  key.lda = p.lda, key.ldb = p.ldb, key.ldc = p.ldc;
  key.batch = p.batch;
  if (p.batch > 1) key.stride_a = p.stride_a, key.stride_b = p.stride_b, key.stride_c = p.stride_c;
  key.epilogue = epilogue;
  key.align_a = cuda::pointer_alignment(p.a);
  key.align_b = cuda::pointer_alignment(p.b);
  key.align_c = cuda::pointer_alignment(p.c);
  key.align_aux = p.pre_gelu    ? cuda::pointer_alignment(p.pre_gelu)
                  : p.bias_grad ? cuda::pointer_alignment(p.bias_grad)
                                : 0;
  return key;
}

// C as written by cuBLAS (vendor_writes.h).
void mark_written(const GemmParams& p, cudaStream_t stream) {
  cuda::mark_vendor_written(p.c, p.m, p.n, p.ldc, p.batch, p.stride_c, dtype_size(p.output_dtype), stream);
}
// Before the call, what it writes without reading (vendor_writes.h): C when beta is 0, and the epilogue's outputs.
void mark_written_before(const GemmParams& p, cublasLtEpilogue_t epilogue, cudaStream_t stream) {
  if (p.beta == 0) mark_written(p, stream);
  if (epilogue == CUBLASLT_EPILOGUE_GELU_AUX || epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
    cuda::mark_vendor_written(p.pre_gelu, p.m, p.n, p.ldc, p.batch, p.stride_c, dtype_size(p.output_dtype), stream);
  if (epilogue == CUBLASLT_EPILOGUE_BGRADB)
    cuda::mark_vendor_written(p.bias_grad, size_t(p.n) * dtype_size(p.output_dtype), stream);
}

// Runs the product with cuBLASLt, with `epilogue` fused; false when cuBLASLt has no algorithm for it.
bool run_cublaslt(const CudaDeviceContext& cuda, const GemmParams& p, cublasLtEpilogue_t epilogue) {
  PlanKey key = make_key(p, epilogue);
  Plan& plan = plan_cache().get(key, [&] { return build_plan(cuda, key, p); });
  if (!plan.has_algo) return false;
  cudaStream_t stream = cuda.cuda_stream();
  void* workspace = cuda.workspace(stream);
  std::lock_guard<std::mutex> lock(plan.mu);
  if (epilogue & CUBLASLT_EPILOGUE_BIAS) set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  if (epilogue == CUBLASLT_EPILOGUE_BGRADB) set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_grad);
  if (epilogue == CUBLASLT_EPILOGUE_GELU_AUX || epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
      epilogue == CUBLASLT_EPILOGUE_DGELU)
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.pre_gelu);
  float alpha32 = float(p.alpha), beta32 = float(p.beta);
  bool f64 = key.compute == CUBLAS_COMPUTE_64F;
  const void* alpha = f64 ? static_cast<const void*>(&p.alpha) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&p.beta) : &beta32;
  mark_written_before(p, epilogue, stream);
  LOOM_CUBLAS_CHECK(cublasLtMatmul(cuda.cublaslt(), plan.desc, alpha, p.a, plan.a, p.b, plan.b, beta, p.c, plan.c,
                                   p.c, plan.c, &plan.algo, workspace, cuda.workspace_bytes(), stream));
  mark_written(p, stream);
  return true;
}

// Legacy cuBLAS for what cuBLASLt declines (it takes 32-bit sizes).
void run_cublas(const CudaDeviceContext& cuda, const GemmParams& p) {
  for (int64_t v : {p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.batch})
    LOOM_REQUIRE(v <= INT32_MAX, "gemm (cuda): no cuBLASLt algorithm for this problem and a size (", v,
                 ") is too large for cuBLAS");
  cublasComputeType_t compute = compute_type(p);
  float alpha32 = float(p.alpha), beta32 = float(p.beta);
  bool f64 = compute == CUBLAS_COMPUTE_64F;
  const void* alpha = f64 ? static_cast<const void*>(&p.alpha) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&p.beta) : &beta32;
  cudaStream_t stream = cuda.cuda_stream();
  void* workspace = cuda.workspace(stream);
  std::lock_guard<std::mutex> lock(cuda.cublas_mutex());
  cublasHandle_t h = cuda.cublas();
  LOOM_CUBLAS_CHECK(cublasSetStream(h, stream));
  LOOM_CUBLAS_CHECK(cublasSetWorkspace(h, workspace, cuda.workspace_bytes()));
  mark_written_before(p, CUBLASLT_EPILOGUE_DEFAULT, stream);
  LOOM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, int(p.m), int(p.n), int(p.k),
      alpha, p.a, cuda_data_type(p.input_dtype), int(p.lda), p.stride_a, p.b, cuda_data_type(p.input_dtype),
      int(p.ldb), p.stride_b, beta, p.c, cuda_data_type(p.output_dtype), int(p.ldc), p.stride_c, int(p.batch),
      compute, CUBLAS_GEMM_DEFAULT));
  mark_written(p, stream);
}

// The unfused epilogue, and the whole result when k == 0 (C = beta * C, which cuBLAS is not asked to do). With
// `product` (alpha op(A) op(B) in f32, dense m x n per problem) the result is product + beta * C, so that a 16-bit C
// is rounded once, after the bias: rounding the product first and adding a bias of the opposite sign after would
// keep only the rounding error (a pre-activation of 0 where the exact one is -0.0017).
template <typename T>
__global__ void epilogue_kernel(T* c, int64_t ldc, int64_t stride_c, int64_t m, int64_t n, int64_t total,
                                bool scale_by_beta, double beta, const T* bias, T* pre_gelu, bool gelu,
                                bool dgelu, const float* product) {
  using acc = acc_t<T>;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t i = idx % m, j = (idx / m) % n, b = idx / (m * n);
    int64_t offset = b * stride_c + j * ldc + i;
    acc v;
    if (product) {
      v = acc(product[idx]);
      if (beta != 0) v += acc(beta) * acc(c[offset]);
    } else if (scale_by_beta) {
      v = beta == 0 ? acc(0) : acc(beta) * acc(c[offset]);  // beta == 0 never reads C (may be NaN)
    } else {
      v = acc(c[offset]);
    }
    if (bias) v += acc(bias[i]);
    if (dgelu) v *= gelu_tanh_derivative(acc(pre_gelu[offset]));
    if (gelu) {
      if (pre_gelu) pre_gelu[offset] = T(v);
      v = gelu_tanh(v);
    }
    c[offset] = T(v);
  }
}

void run_epilogue(const CudaDeviceContext& cuda, const GemmParams& p, bool scale_by_beta,
                  const float* product = nullptr) {
  bool add_bias = p.epilogue == GemmEpilogue::kBias || p.epilogue == GemmEpilogue::kBiasGelu;
  bool gelu = p.epilogue == GemmEpilogue::kGelu || p.epilogue == GemmEpilogue::kBiasGelu;
  bool dgelu = p.epilogue == GemmEpilogue::kDGelu;
  if (!product && !scale_by_beta && !add_bias && !gelu && !dgelu) return;
  int64_t total = p.m * p.n * p.batch;
  unsigned grid = unsigned(std::min<int64_t>((total + 255) / 256, 65536));
  LOOM_DISPATCH_FLOATING(p.output_dtype, "gemm", [&] {
    epilogue_kernel<scalar_t><<<grid, 256, 0, cuda.cuda_stream()>>>(
        static_cast<scalar_t*>(p.c), p.ldc, p.stride_c, p.m, p.n, total, scale_by_beta, p.beta,
        add_bias ? static_cast<const scalar_t*>(p.bias) : nullptr,
        gelu || dgelu ? static_cast<scalar_t*>(p.pre_gelu) : nullptr, gelu, dgelu, product);
  });
  LOOM_CUDA_CHECK_LAUNCH();
}

// The cuBLASLt epilogue for the request, or DEFAULT when it has to run unfused.
cublasLtEpilogue_t fused_epilogue(const GemmParams& p) {
  if (p.epilogue == GemmEpilogue::kNone || p.input_dtype == kF64) return CUBLASLT_EPILOGUE_DEFAULT;
  if (p.epilogue == GemmEpilogue::kBiasGradB)
    return cuda::pointer_alignment(p.bias_grad) < 16 ? CUBLASLT_EPILOGUE_DEFAULT : CUBLASLT_EPILOGUE_BGRADB;
  if (p.epilogue == GemmEpilogue::kDGelu) {
    // cuBLASLt's GELU derivative is approximate (about 4e-5 relative, measured on an H100): far below a 16-bit
    // output's rounding, but not f32's, so f32 takes the exact epilogue kernel. The aux (pre-activation) has C's
    // layout: its ld must be a multiple of 8 and its start 16-byte aligned.
    bool sixteen_bit = p.output_dtype == kBF16 || p.output_dtype == kF16;
    return !sixteen_bit || p.ldc % 8 != 0 || cuda::pointer_alignment(p.pre_gelu) < 16 ? CUBLASLT_EPILOGUE_DEFAULT
                                                                           : CUBLASLT_EPILOGUE_DGELU;
  }
  bool bias = p.epilogue == GemmEpilogue::kBias || p.epilogue == GemmEpilogue::kBiasGelu;
  bool gelu = p.epilogue == GemmEpilogue::kGelu || p.epilogue == GemmEpilogue::kBiasGelu;
  if (bias && cuda::pointer_alignment(p.bias) < 16) return CUBLASLT_EPILOGUE_DEFAULT;
  bool aux = gelu && p.pre_gelu;
  // cuBLASLt needs the aux leading dimension and batch stride to be multiples of 8.
  if (aux && (p.ldc % 8 != 0 || (p.batch > 1 && p.stride_c % 8 != 0) || cuda::pointer_alignment(p.pre_gelu) < 16))
    return CUBLASLT_EPILOGUE_DEFAULT;
  if (!gelu) return CUBLASLT_EPILOGUE_BIAS;
  if (aux) return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
}

// kBiasGradB without cuBLASLt's epilogue: the deterministic column-sum kernel over op(B), a dense [k, n] matrix.
void bias_grad_unfused(const DeviceContext& ctx, const GemmParams& p) {
  Tensor b = from_blob(const_cast<void*>(p.b), {p.k, p.n}, p.input_dtype, p.device);
  Tensor sums = from_blob(p.bias_grad, {p.n}, p.output_dtype, p.device);
  dispatch::call(column_sums_op, ctx.device(), p.input_dtype, b, sums);
}

void gemm_cuda(const DeviceContext& ctx, const GemmParams& p) {
  LOOM_REQUIRE(p.device.type == DeviceType::kCUDA && p.device == ctx.device(), "gemm (cuda): the operands are on ",
               p.device.str(), " but the kernel runs on ", ctx.device().str());
  bool widening = (p.input_dtype == kBF16 || p.input_dtype == kF16) && p.output_dtype == kF32;
  LOOM_REQUIRE(p.input_dtype == p.output_dtype || widening, "gemm (cuda): input dtype ", dtype_name(p.input_dtype),
               " with output dtype ", dtype_name(p.output_dtype), " is not supported");
  if (p.m == 0 || p.n == 0 || p.batch == 0) return;
  const CudaDeviceContext& cuda = cuda_context(ctx);
  cuda::DeviceGuard guard(ctx.device().index);
  if (p.k == 0) {  // an empty sum: C = beta * C, then the epilogue
    run_epilogue(cuda, p, /*scale_by_beta=*/true);
    if (p.epilogue == GemmEpilogue::kBiasGradB) bias_grad_unfused(ctx, p);
    return;
  }
  cublasLtEpilogue_t fused = fused_epilogue(p);
  if (fused != CUBLASLT_EPILOGUE_DEFAULT && run_cublaslt(cuda, p, fused)) return;
  const bool sixteen_bit = p.output_dtype == kBF16 || p.output_dtype == kF16;
  if (sixteen_bit && p.epilogue != GemmEpilogue::kNone && p.epilogue != GemmEpilogue::kBiasGradB) {
    // An unfused epilogue on a 16-bit C: the product in f32 first, the epilogue rounding once (epilogue_kernel).
    Tensor product = empty({p.batch * p.m * p.n}, kF32, p.device);
    GemmParams q = p;
    q.c = product.data(), q.ldc = p.m, q.stride_c = p.m * p.n, q.output_dtype = kF32;
    q.beta = 0, q.epilogue = GemmEpilogue::kNone, q.bias = nullptr, q.pre_gelu = nullptr;
    if (!run_cublaslt(cuda, q, CUBLASLT_EPILOGUE_DEFAULT)) run_cublas(cuda, q);
    return run_epilogue(cuda, p, /*scale_by_beta=*/false, static_cast<const float*>(product.data()));
  }
  if (!run_cublaslt(cuda, p, CUBLASLT_EPILOGUE_DEFAULT)) run_cublas(cuda, p);
  if (p.epilogue == GemmEpilogue::kBiasGradB) return bias_grad_unfused(ctx, p);
  run_epilogue(cuda, p, /*scale_by_beta=*/false);
}

}  // namespace

LOOM_REGISTER_KERNEL(gemm, kCUDA, "native", dtypes(kF32, kF64, kBF16, kF16), gemm_cuda);

}  // namespace loom
