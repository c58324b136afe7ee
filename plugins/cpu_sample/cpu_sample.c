/* A sample CPU kernel library for Loom, written only against loom/abi/loom_kernel_abi.h (plain C, no Loom C++).
 * It implements gemm (a cache-blocked loop, not OpenBLAS), add (any strides, broadcasting) and softmax, all for
 * float32, and declines the gemm epilogues with a gelu through supports(), so Loom falls back to its own kernel.
 *
 * Test-only variants (compile definitions):
 *   LOOM_SAMPLE_WRONG_SOFTMAX   softmax leaves the last element of each row out of the sum: the conformance suite
 *                               must catch it;
 *   LOOM_SAMPLE_ABI_MAJOR=N     claims ABI major version N: Loom must refuse to load it.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "loom_kernel_abi.h"

#ifndef LOOM_SAMPLE_ABI_MAJOR
#define LOOM_SAMPLE_ABI_MAJOR LOOM_ABI_VERSION_MAJOR
#endif
#ifndef LOOM_SAMPLE_NAME
#define LOOM_SAMPLE_NAME "cpu_sample"
#endif

static _Thread_local char last_error_message[512];
static const LoomHost* host;

static int fail(int status, const char* message) {
  snprintf(last_error_message, sizeof last_error_message, "%s", message);
  return status;
}

static const char* sample_last_error(void* ctx) {
  (void)ctx;
  return last_error_message;
}

/* ---- gemm: C = alpha * op(A) op(B) + beta * C, column-major, strided batch, optional bias. ---- */

enum { BLOCK = 64 };

static int sample_gemm_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                                const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)n_in;
  (void)n_out;
  int64_t epilogue = loom_attr_int(attrs, n_attrs, "epilogue", 0);
  int64_t compute = loom_attr_int(attrs, n_attrs, "compute", 0);
  /* f32 in, f32 out, no gelu epilogue, no f64 compute request. */
  return in[0].dtype == LOOM_DTYPE_F32 && out[0].dtype == LOOM_DTYPE_F32 && (epilogue == 0 || epilogue == 1) &&
         compute != 2;
}

static int sample_gemm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                       const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 3 || n_out != 2) return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm: expected 3 inputs and 2 outputs");
  const int trans_a = (int)loom_attr_int(attrs, n_attrs, "trans_a", 0);
  const int trans_b = (int)loom_attr_int(attrs, n_attrs, "trans_b", 0);
  const int64_t m = loom_attr_int(attrs, n_attrs, "m", 0), n = loom_attr_int(attrs, n_attrs, "n", 0);
  const int64_t k = loom_attr_int(attrs, n_attrs, "k", 0), batch = loom_attr_int(attrs, n_attrs, "batch", 1);
  const int64_t lda = loom_attr_int(attrs, n_attrs, "lda", 0), ldb = loom_attr_int(attrs, n_attrs, "ldb", 0);
  const int64_t ldc = loom_attr_int(attrs, n_attrs, "ldc", 0);
  const int64_t sa = loom_attr_int(attrs, n_attrs, "stride_a", 0), sb = loom_attr_int(attrs, n_attrs, "stride_b", 0);
  const int64_t sc = loom_attr_int(attrs, n_attrs, "stride_c", 0);
  const float alpha = (float)loom_attr_float(attrs, n_attrs, "alpha", 1.0);
  const float beta = (float)loom_attr_float(attrs, n_attrs, "beta", 0.0);
  const int64_t epilogue = loom_attr_int(attrs, n_attrs, "epilogue", 0);
  if (epilogue != 0 && epilogue != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm: gelu epilogues unsupported");
  const float* bias = (const float*)in[2].data;
  if (epilogue == 1 && !bias) return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm: bias epilogue without a bias");

  for (int64_t b = 0; b < batch; ++b) {
    const float* A = (const float*)in[0].data + b * sa;
    const float* B = (const float*)in[1].data + b * sb;
    float* C = (float*)out[0].data + b * sc;
    /* Scale C by beta first (beta == 0 overwrites, ignoring NaN in C), then accumulate block by block. */
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) C[i + j * ldc] = beta == 0.0f ? 0.0f : beta * C[i + j * ldc];
    for (int64_t j0 = 0; j0 < n; j0 += BLOCK)
      for (int64_t p0 = 0; p0 < k; p0 += BLOCK)
        for (int64_t i0 = 0; i0 < m; i0 += BLOCK) {
          const int64_t j1 = j0 + BLOCK < n ? j0 + BLOCK : n;
          const int64_t p1 = p0 + BLOCK < k ? p0 + BLOCK : k;
          const int64_t i1 = i0 + BLOCK < m ? i0 + BLOCK : m;
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t i = i0; i < i1; ++i) {
              float acc = 0.0f;
              for (int64_t p = p0; p < p1; ++p) {
                const float a = trans_a ? A[p + i * lda] : A[i + p * lda];
                const float bb = trans_b ? B[j + p * ldb] : B[p + j * ldb];
                acc += a * bb;
              }
              C[i + j * ldc] += alpha * acc;
            }
        }
    if (epilogue == 1)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < m; ++i) C[i + j * ldc] += bias[i];
  }
  return LOOM_STATUS_OK;
}

/* ---- add: out = a + b over out's shape, any strides (broadcast inputs have stride 0). ---- */

static int sample_add(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                      const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 2 || n_out != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "add: expected 2 inputs and 1 output");
  const LoomTensorDesc* o = &out[0];
  for (int t = 0; t < 2; ++t)
    if (in[t].rank != o->rank) return fail(LOOM_STATUS_INVALID_ARGUMENT, "add: input rank differs from output's");
  const int64_t total = loom_desc_numel(o);
  int64_t index[LOOM_MAX_DIMS] = {0};
  const float* a = (const float*)in[0].data;
  const float* b = (const float*)in[1].data;
  float* c = (float*)o->data;
  int64_t oa = 0, ob = 0, oc = 0;
  for (int64_t e = 0; e < total; ++e) {
    c[oc] = a[oa] + b[ob];
    /* Advance the multi-index (last dim fastest) and the three offsets with it. */
    for (int d = o->rank - 1; d >= 0; --d) {
      if (++index[d] < o->shape[d]) {
        oa += in[0].strides[d], ob += in[1].strides[d], oc += o->strides[d];
        break;
      }
      oa -= (o->shape[d] - 1) * in[0].strides[d];
      ob -= (o->shape[d] - 1) * in[1].strides[d];
      oc -= (o->shape[d] - 1) * o->strides[d];
      index[d] = 0;
    }
  }
  return LOOM_STATUS_OK;
}

/* ---- softmax along `dim` of a contiguous tensor, in double. ---- */

static int sample_softmax(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                          const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 1 || n_out != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "softmax: expected 1 input and 1 output");
  const LoomTensorDesc* x = &in[0];
  const int64_t dim = loom_attr_int(attrs, n_attrs, "dim", x->rank - 1);
  if (dim < 0 || dim >= x->rank) return fail(LOOM_STATUS_INVALID_ARGUMENT, "softmax: dim out of range");
  if (!loom_desc_is_contiguous(x) || !loom_desc_is_contiguous(&out[0]))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "softmax: tensors must be contiguous");
  int64_t outer = 1, inner = 1;
  const int64_t len = x->shape[dim];
  for (int d = 0; d < dim; ++d) outer *= x->shape[d];
  for (int d = (int)dim + 1; d < x->rank; ++d) inner *= x->shape[d];
  const float* src = (const float*)x->data;
  float* dst = (float*)out[0].data;
#ifdef LOOM_SAMPLE_WRONG_SOFTMAX
  const int64_t summed = len > 1 ? len - 1 : len; /* the deliberate bug */
#else
  const int64_t summed = len;
#endif
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      const float* xr = src + o * len * inner + i;
      float* yr = dst + o * len * inner + i;
      double mx = -INFINITY, sum = 0;
      for (int64_t t = 0; t < len; ++t) mx = xr[t * inner] > mx ? xr[t * inner] : mx;
      for (int64_t t = 0; t < summed; ++t) sum += exp((double)xr[t * inner] - mx);
      for (int64_t t = 0; t < len; ++t) yr[t * inner] = (float)(exp((double)xr[t * inner] - mx) / sum);
    }
  return LOOM_STATUS_OK;
}

static const LoomOpEntry sample_ops[] = {
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "gemm", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_gemm,
     sample_gemm_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "add", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_add, NULL, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "softmax", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_softmax, NULL, {0}},
    /* Not a Loom op: Loom warns and loads the rest. */
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "sample_frobnicate", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_add, NULL,
     {0}},
};

LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* h, LoomProvider* p) {
  /* Fill in the version first: Loom checks it even when init fails. */
  p->abi_major = LOOM_SAMPLE_ABI_MAJOR;
  p->abi_minor = LOOM_ABI_VERSION_MINOR;
  p->last_error = sample_last_error;
  if (h->struct_size < sizeof(LoomHost) - sizeof(h->reserved) || h->abi_major != LOOM_SAMPLE_ABI_MAJOR)
    return fail(LOOM_STATUS_UNSUPPORTED, "cpu_sample: host ABI does not match");
  host = h;
  p->name = LOOM_SAMPLE_NAME;
  p->version = "0.1";
  p->ctx = NULL;
  p->ops = sample_ops;
  p->n_ops = (int32_t)(sizeof sample_ops / sizeof sample_ops[0]);
  if (host->log) host->log(host->host_ctx, LOOM_LOG_DEBUG, "cpu_sample initialized");
  return LOOM_STATUS_OK;
}
