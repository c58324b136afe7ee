/* A sample CPU kernel library for Loom, written only against loom/abi/loom_kernel_abi.h (plain C, no Loom C++).
 * It implements gemm (a cache-blocked loop, not OpenBLAS), add (any strides, broadcasting) and softmax, and from
 * ABI 1.1 the fused ops a training step calls: residual_layer_norm and residual_rms_norm with their backwards,
 * cross_entropy_with_grad and cross_entropy_scale_grad, column_sums, rope_strided, adamw_update, sgd_update and
 * grad_norm_squared; all for float32. It declines through supports() what it does not do (the gemm epilogues with a
 * gelu, the norms' bf16/f16 activations beside an f32 residual, a 16-bit gradient), so Loom falls back to its own
 * kernels.
 *
 * Test-only variants (compile definitions):
 *   LOOM_SAMPLE_WRONG_SOFTMAX   softmax leaves the last element of each row out of the sum: the conformance suite
 *                               must catch it;
 *   LOOM_SAMPLE_WRONG_FUSED     the fused norms' backward drops grad_residual, and cross_entropy_with_grad's mean
 *                               divides by every row instead of the counted ones: the suite must catch both;
 *   LOOM_SAMPLE_ABI_MAJOR=N     claims ABI major version N: Loom must refuse to load it;
 *   LOOM_SAMPLE_ABI_MINOR=N     claims ABI minor version N (0: a library built before the fused ops; Loom must load
 *                               it, binding its 1.0 ops and skipping the 1.1 ones with a warning).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "loom_kernel_abi.h"

#ifndef LOOM_SAMPLE_ABI_MAJOR
#define LOOM_SAMPLE_ABI_MAJOR LOOM_ABI_VERSION_MAJOR
#endif
#ifndef LOOM_SAMPLE_ABI_MINOR
#define LOOM_SAMPLE_ABI_MINOR LOOM_ABI_VERSION_MINOR
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

/* ---- The residual add fused into layer norm (centered) or RMS norm, over the last dim of contiguous f32 tensors.
 * Row statistics in double, as Loom's CPU kernels compute them. ---- */

static int all_f32_contiguous(const LoomTensorDesc* t, int n) {
  for (int i = 0; i < n; ++i)
    if (t[i].data && (t[i].dtype != LOOM_DTYPE_F32 || !loom_desc_is_contiguous(&t[i]))) return 0;
  return 1;
}

/* Declines autocast's bf16/f16 delta and out beside an f32 residual: the statistics (mean, rstd) are f32 too. */
static int sample_f32_only_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                    int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  return all_f32_contiguous(in, n_in) && all_f32_contiguous(out, n_out);
}

static void rows_and_cols(const LoomTensorDesc* x, int64_t* rows, int64_t* cols) {
  *cols = x->rank > 0 ? x->shape[x->rank - 1] : 1;
  *rows = *cols > 0 ? loom_desc_numel(x) / *cols : 0;
}

/* in: x, delta?, weight?, bias? (centered only); out: residual?, out, mean (centered only), rstd. */
static int residual_norm_forward(const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                                 const LoomAttr* attrs, int n_attrs, int centered) {
  if (n_in != 3 + centered || n_out != 3 + centered)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "residual norm: unexpected argument count");
  const float* x = (const float*)in[0].data;
  const float* delta = (const float*)in[1].data;
  const float* weight = (const float*)in[2].data;
  const float* bias = centered ? (const float*)in[3].data : NULL;
  float* residual = (float*)out[0].data;
  float* y = (float*)out[1].data;
  float* mean_out = centered ? (float*)out[2].data : NULL;
  float* rstd_out = (float*)out[2 + centered].data;
  if (delta && !residual) return fail(LOOM_STATUS_INVALID_ARGUMENT, "residual norm: a delta needs a residual");
  const double eps = loom_attr_float(attrs, n_attrs, "eps", 1e-5);
  int64_t rows, cols;
  rows_and_cols(&in[0], &rows, &cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    if (delta) { /* the residual, rounded to f32, is what gets normalized */
      float* rr = residual + r * cols;
      for (int64_t c = 0; c < cols; ++c) rr[c] = xr[c] + delta[r * cols + c];
      xr = rr;
    }
    double mean = 0, sq = 0;
    if (centered) {
      for (int64_t c = 0; c < cols; ++c) mean += xr[c];
      mean = cols ? mean / (double)cols : 0.0;
    }
    for (int64_t c = 0; c < cols; ++c) sq += ((double)xr[c] - mean) * ((double)xr[c] - mean);
    const double rstd = 1.0 / sqrt((cols ? sq / (double)cols : 0.0) + eps);
    if (centered) mean_out[r] = (float)mean;
    rstd_out[r] = (float)rstd;
    for (int64_t c = 0; c < cols; ++c) {
      float v = (xr[c] - (float)mean) * (float)rstd;
      if (weight) v *= weight[c];
      if (bias) v += bias[c];
      y[r * cols + c] = v;
    }
  }
  return LOOM_STATUS_OK;
}

/* in: grad_out, grad_residual?, residual, weight?, mean (centered only), rstd;
 * out: grad_x?, grad_delta?, grad_weight?, grad_bias? (centered only). */
static int residual_norm_backward(const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                                  int centered) {
  if (n_in != 5 + centered || n_out != 3 + centered)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "residual norm backward: unexpected argument count");
  const float* g = (const float*)in[0].data;
  const float* grad_residual = (const float*)in[1].data;
#ifdef LOOM_SAMPLE_WRONG_FUSED
  grad_residual = NULL; /* the deliberate bug: the residual's own gradient is dropped */
#endif
  const float* x = (const float*)in[2].data;
  const float* weight = (const float*)in[3].data;
  const float* mean = centered ? (const float*)in[4].data : NULL;
  const float* rstd = (const float*)in[4 + centered].data;
  float* gx = (float*)out[0].data;
  float* gd = (float*)out[1].data;
  float* gw = (float*)out[2].data;
  float* gb = centered ? (float*)out[3].data : NULL;
  int64_t rows, cols;
  rows_and_cols(&in[2], &rows, &cols);
#define XHAT(r, c) (((double)x[(r) * cols + (c)] - (mean ? (double)mean[r] : 0.0)) * (double)rstd[r])
  if (gx || gd) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* gr = g + r * cols;
      double sum_g = 0, sum_g_xhat = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double wg = (double)gr[c] * (weight ? (double)weight[c] : 1.0);
        sum_g += wg;
        sum_g_xhat += wg * XHAT(r, c);
      }
      const double mean_g = mean ? sum_g / (double)cols : 0.0, mean_g_xhat = sum_g_xhat / (double)cols;
      for (int64_t c = 0; c < cols; ++c) {
        const double wg = (double)gr[c] * (weight ? (double)weight[c] : 1.0);
        double v = (double)rstd[r] * (wg - mean_g - XHAT(r, c) * mean_g_xhat);
        if (grad_residual) v += grad_residual[r * cols + c];
        if (gx) gx[r * cols + c] = (float)v;
        if (gd) gd[r * cols + c] = (float)v;
      }
    }
  }
  for (int64_t c = 0; c < cols && (gw || gb); ++c) {
    double acc_w = 0, acc_b = 0;
    for (int64_t r = 0; r < rows; ++r) {
      acc_w += (double)g[r * cols + c] * XHAT(r, c);
      acc_b += g[r * cols + c];
    }
    if (gw) gw[c] = (float)acc_w;
    if (gb) gb[c] = (float)acc_b;
  }
#undef XHAT
  return LOOM_STATUS_OK;
}

static int sample_residual_layer_norm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                      int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  return residual_norm_forward(in, n_in, out, n_out, attrs, n_attrs, 1);
}
static int sample_residual_rms_norm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                    int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  return residual_norm_forward(in, n_in, out, n_out, attrs, n_attrs, 0);
}
static int sample_residual_layer_norm_backward(void* ctx, const LoomTensorDesc* in, int n_in,
                                               const LoomTensorDesc* out, int n_out, const LoomAttr* attrs,
                                               int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  return residual_norm_backward(in, n_in, out, n_out, 1);
}
static int sample_residual_rms_norm_backward(void* ctx, const LoomTensorDesc* in, int n_in,
                                             const LoomTensorDesc* out, int n_out, const LoomAttr* attrs,
                                             int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  return residual_norm_backward(in, n_in, out, n_out, 0);
}

/* ---- cross_entropy_with_grad: the loss (mean or sum) and the logits' gradient for a loss gradient of 1, in one
 * pass over f32 logits [N, V]. grad_logits may be the logits themselves: each row is read before it is written. ---- */

static int64_t target_at(const LoomTensorDesc* t, int64_t i) {
  return t->dtype == LOOM_DTYPE_I32 ? (int64_t)((const int32_t*)t->data)[i] : ((const int64_t*)t->data)[i];
}

static int sample_cross_entropy_with_grad_supports(void* ctx, const LoomTensorDesc* in, int n_in,
                                                   const LoomTensorDesc* out, int n_out, const LoomAttr* attrs,
                                                   int n_attrs) {
  (void)ctx;
  (void)n_in;
  (void)n_out;
  (void)attrs;
  (void)n_attrs;
  return (in[1].dtype == LOOM_DTYPE_I32 || in[1].dtype == LOOM_DTYPE_I64) && out[0].dtype == LOOM_DTYPE_F32 &&
         out[1].dtype == LOOM_DTYPE_F32;
}

static int sample_cross_entropy_with_grad(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                          int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 2 || n_out != 2 || in[0].rank != 2)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "cross_entropy_with_grad: expected logits [N, V], targets, 2 outputs");
  const int64_t n = in[0].shape[0], vocab = in[0].shape[1];
  const int64_t ignore_index = loom_attr_int(attrs, n_attrs, "ignore_index", -100);
  const int64_t reduction = loom_attr_int(attrs, n_attrs, "reduction", 0);
  const int64_t limit = loom_attr_int(attrs, n_attrs, "vocab_limit", -1);
  const int64_t classes = limit < 0 ? vocab : limit;
  if (reduction != 0 && reduction != 1)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "cross_entropy_with_grad: reduction must be mean or sum");
  const float* logits = (const float*)in[0].data;
  float* grad = (float*)out[1].data;
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = target_at(&in[1], i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= classes) {
      snprintf(last_error_message, sizeof last_error_message,
               "cross_entropy_with_grad: target %lld at position %lld is out of range for %lld classes",
               (long long)t, (long long)i, (long long)classes);
      return LOOM_STATUS_INVALID_ARGUMENT;
    }
    ++counted;
  }
#ifdef LOOM_SAMPLE_WRONG_FUSED
  const int64_t divisor = n; /* the deliberate bug: ignored rows counted in the mean */
#else
  const int64_t divisor = counted;
#endif
  const double scale = reduction == 0 ? (divisor ? 1.0 / (double)divisor : 0.0) : 1.0;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + i * vocab;
    float* grow = grad + i * vocab;
    const int64_t t = target_at(&in[1], i);
    if (t == ignore_index) {
      for (int64_t j = 0; j < vocab; ++j) grow[j] = 0.0f;
      continue;
    }
    const double target_logit = row[t];
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < classes; ++j) m = row[j] > m ? row[j] : m;
    for (int64_t j = 0; j < classes; ++j) s += exp((double)row[j] - m);
    total += (m - target_logit) + log(s);
    for (int64_t j = 0; j < classes; ++j) grow[j] = (float)(exp((double)row[j] - m) / s * scale);
    for (int64_t j = classes; j < vocab; ++j) grow[j] = 0.0f;
    grow[t] -= (float)scale;
  }
  if (reduction == 0) total = divisor ? total / (double)divisor : NAN;
  *(float*)out[0].data = (float)total;
  return LOOM_STATUS_OK;
}

/* grad_logits *= scale, in place; scale is one f32 element. */
static int sample_cross_entropy_scale_grad(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                           int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 1 || n_out != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "cross_entropy_scale_grad: 1 in, 1 out");
  const float scale = *(const float*)in[0].data;
  if (scale == 1.0f) return LOOM_STATUS_OK;
  float* g = (float*)out[0].data;
  for (int64_t i = 0, n = loom_desc_numel(&out[0]); i < n; ++i) g[i] *= scale;
  return LOOM_STATUS_OK;
}

/* out[c] = sum over rows of matrix[r, c], in double. */
static int sample_column_sums(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                              const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 1 || n_out != 1 || in[0].rank != 2)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "column_sums: expected a [rows, cols] matrix and one output");
  const int64_t rows = in[0].shape[0], cols = in[0].shape[1];
  const float* m = (const float*)in[0].data;
  float* o = (float*)out[0].data;
  for (int64_t c = 0; c < cols; ++c) {
    double acc = 0;
    for (int64_t r = 0; r < rows; ++r) acc += m[r * cols + c];
    o[c] = (float)acc;
  }
  return LOOM_STATUS_OK;
}

/* Rotary embedding on [B, H, T, D] views (x and out each with their own strides), pairs (i, i + D/2). */
static int sample_rope_strided(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                               const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 3 || n_out != 1 || in[0].rank != 4 || out[0].rank != 4)
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "rope_strided: expected x [B, H, T, D], cos, sin and out");
  const LoomTensorDesc *x = &in[0], *y = &out[0];
  const int64_t half = x->shape[3] / 2;
  const float* cs = (const float*)in[1].data;
  const float* sn = (const float*)in[2].data;
  const float sign = loom_attr_int(attrs, n_attrs, "inverse", 0) ? -1.0f : 1.0f;
  for (int64_t b = 0; b < x->shape[0]; ++b)
    for (int64_t h = 0; h < x->shape[1]; ++h)
      for (int64_t t = 0; t < x->shape[2]; ++t) {
        const float* xr = (const float*)x->data + b * x->strides[0] + h * x->strides[1] + t * x->strides[2];
        float* yr = (float*)y->data + b * y->strides[0] + h * y->strides[1] + t * y->strides[2];
        for (int64_t i = 0; i < half; ++i) {
          const float first = xr[i * x->strides[3]], second = xr[(i + half) * x->strides[3]];
          const float c = cs[t * half + i], s = sign * sn[t * half + i];
          yr[i * y->strides[3]] = first * c - second * s;
          yr[(i + half) * y->strides[3]] = second * c + first * s;
        }
      }
  return LOOM_STATUS_OK;
}

/* ---- Optimizer updates on f32 parameters with f32 gradients, in place (param and states are outputs). ---- */

static int sample_f32_grad_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                    int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)n_in;
  (void)out;
  (void)n_out;
  (void)attrs;
  (void)n_attrs;
  return in[0].dtype == LOOM_DTYPE_F32;
}

static int sample_adamw_update(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                               const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 1 || n_out != 3) return fail(LOOM_STATUS_INVALID_ARGUMENT, "adamw_update: expected grad; param, m, v");
  const double lr = loom_attr_float(attrs, n_attrs, "lr", 1e-3);
  const double wd = loom_attr_float(attrs, n_attrs, "weight_decay", 0);
  const double beta1 = loom_attr_float(attrs, n_attrs, "beta1", 0.9);
  const double beta2 = loom_attr_float(attrs, n_attrs, "beta2", 0.999);
  const double eps = loom_attr_float(attrs, n_attrs, "eps", 1e-8);
  const double step = (double)loom_attr_int(attrs, n_attrs, "step", 1);
  const double step_size = lr / (1 - pow(beta1, step)), root_correction = sqrt(1 - pow(beta2, step));
  const float* g = (const float*)in[0].data;
  float* p = (float*)out[0].data;
  float* m = (float*)out[1].data;
  float* v = (float*)out[2].data;
  for (int64_t i = 0, n = loom_desc_numel(&out[0]); i < n; ++i) {
    const double gi = g[i];
    const double mi = beta1 * m[i] + (1 - beta1) * gi, vi = beta2 * v[i] + (1 - beta2) * gi * gi;
    const double pi = p[i] * (1 - lr * wd);
    p[i] = (float)(pi - step_size * mi / (sqrt(vi) / root_correction + eps));
    m[i] = (float)mi;
    v[i] = (float)vi;
  }
  return LOOM_STATUS_OK;
}

static int sample_sgd_update(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                             const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 1 || n_out != 2) return fail(LOOM_STATUS_INVALID_ARGUMENT, "sgd_update: expected grad; param, buffer");
  const double lr = loom_attr_float(attrs, n_attrs, "lr", 1e-2);
  const double wd = loom_attr_float(attrs, n_attrs, "weight_decay", 0);
  const double momentum = loom_attr_float(attrs, n_attrs, "momentum", 0);
  const int first_step = (int)loom_attr_int(attrs, n_attrs, "first_step", 0);
  const float* g = (const float*)in[0].data;
  float* p = (float*)out[0].data;
  float* buf = (float*)out[1].data; /* NULL when momentum == 0 */
  if (momentum != 0 && !buf) return fail(LOOM_STATUS_INVALID_ARGUMENT, "sgd_update: momentum without a buffer");
  for (int64_t i = 0, n = loom_desc_numel(&out[0]); i < n; ++i) {
    double d = g[i] + wd * p[i];
    if (momentum != 0) {
      d = first_step ? d : momentum * buf[i] + d;
      buf[i] = (float)d;
    }
    p[i] = (float)(p[i] - lr * d);
  }
  return LOOM_STATUS_OK;
}

/* out (one f64 element) = sum of x^2, in double. */
static int sample_grad_norm_squared(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                                    int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 1 || n_out != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "grad_norm_squared: 1 in, 1 out");
  const float* x = (const float*)in[0].data;
  double acc = 0;
  for (int64_t i = 0, n = loom_desc_numel(&in[0]); i < n; ++i) acc += (double)x[i] * x[i];
  *(double*)out[0].data = acc;
  return LOOM_STATUS_OK;
}

/* ---- ABI 1.2: arange, and cat (a list of inputs: n_in is their count, any strides; out contiguous). ---- */

static int sample_arange(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                         const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)in;
  if (n_in != 0 || n_out != 1) return fail(LOOM_STATUS_INVALID_ARGUMENT, "arange: expected no input and 1 output");
  const double start = loom_attr_float(attrs, n_attrs, "start", 0), step = loom_attr_float(attrs, n_attrs, "step", 1);
  float* o = (float*)out[0].data;
  for (int64_t i = 0, n = loom_desc_numel(&out[0]); i < n; ++i) o[i * out[0].strides[0]] = (float)(start + (double)i * step);
  return LOOM_STATUS_OK;
}

static int sample_cat(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                      const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_out != 1 || !loom_desc_is_contiguous(&out[0])) return fail(LOOM_STATUS_INVALID_ARGUMENT, "cat: one contiguous output");
  const LoomTensorDesc* o = &out[0];
  const int64_t dim = loom_attr_int(attrs, n_attrs, "dim", 0);
  if (dim < 0 || dim >= o->rank) return fail(LOOM_STATUS_INVALID_ARGUMENT, "cat: dim out of range");
  int64_t base = 0; /* where along dim the current input starts */
  for (int t = 0; t < n_in; ++t) {
    const LoomTensorDesc* x = &in[t];
    int64_t index[LOOM_MAX_DIMS] = {0};
    for (int64_t e = 0, n = loom_desc_numel(x); e < n; ++e) {
      int64_t src = 0, dst = 0;
      for (int d = 0; d < x->rank; ++d) {
        src += index[d] * x->strides[d];
        dst += (index[d] + (d == dim ? base : 0)) * o->strides[d];
      }
      ((float*)o->data)[dst] = ((const float*)x->data)[src];
      for (int d = x->rank - 1; d >= 0; --d) {
        if (++index[d] < x->shape[d]) break;
        index[d] = 0;
      }
    }
    base += x->shape[dim];
  }
  return LOOM_STATUS_OK;
}

static const LoomOpEntry sample_ops[] = {
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "gemm", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_gemm,
     sample_gemm_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "add", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_add, NULL, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "softmax", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_softmax, NULL, {0}},
    /* ABI 1.1: the fused ops of a training step. */
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "residual_layer_norm", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_residual_layer_norm, sample_f32_only_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "residual_layer_norm_backward", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_residual_layer_norm_backward, sample_f32_only_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "residual_rms_norm", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_residual_rms_norm, sample_f32_only_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "residual_rms_norm_backward", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_residual_rms_norm_backward, sample_f32_only_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "cross_entropy_with_grad", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_cross_entropy_with_grad, sample_cross_entropy_with_grad_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "cross_entropy_scale_grad", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_cross_entropy_scale_grad, NULL, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "column_sums", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_column_sums, NULL,
     {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "rope_strided", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_rope_strided,
     NULL, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "adamw_update", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_adamw_update,
     sample_f32_grad_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "sgd_update", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_sgd_update,
     sample_f32_grad_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "grad_norm_squared", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0,
     sample_grad_norm_squared, NULL, {0}},
    /* ABI 1.2. */
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "arange", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_arange, NULL, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "cat", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_cat, NULL, {0}},
    /* Not a Loom op: Loom warns and loads the rest. */
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "sample_frobnicate", LOOM_DTYPE_BIT(LOOM_DTYPE_F32), 0, sample_add, NULL,
     {0}},
};

LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* h, LoomProvider* p) {
  /* Fill in the version first: Loom checks it even when init fails. */
  p->abi_major = LOOM_SAMPLE_ABI_MAJOR;
  p->abi_minor = LOOM_SAMPLE_ABI_MINOR;
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
