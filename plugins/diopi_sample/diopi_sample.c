/* A sample DIOPI implementation library (a "libdiopi_impl.so"), written only against the DIOPI headers
 * (diopi/diopirt.h, functions.h, functions_ext.h): plain C11, its own kernels, no Loom code. Loom's DIOPI bridge
 * loads it like any vendor's library; the framework provides the diopirt runtime (tensor accessors, scratch
 * allocation, generators), which this library calls and never defines.
 *
 * Functions: mm, bmm, addmm, baddbmm, linear (+backward), layerNorm, rmsNorm, softmax, logSoftmax, gelu, silu,
 * embedding, crossEntropyLoss (each +backward), adamW, flashAttention (+backward), rotaryEmbedding, add, addScalar,
 * mul, mulScalar, fill, sum, castDtype, copyInp, clipGradNorm, dropout.
 *
 * Every kernel runs on the host (tensors whose device is diopi_host; a device tensor gets diopiNoImplement so the
 * caller falls back). Floating dtypes float16, bfloat16, float32 and float64 are served; each kernel reads its
 * inputs through their shape and strides into float64 scratch (from diopiRequireBuffer, i.e. the framework's
 * allocator), computes in float64 and writes through the output's strides, so any layout -- transposed, padded,
 * broadcast (stride 0), offset -- is honoured for inputs and outputs alike. It is correct, not fast.
 *
 * Contracts that the headers leave open, decided here (and returned as diopiNoImplement where not served):
 *   - diopiRMSNorm with a bias: the reference implementation ignores it, others add it; ambiguous -> NoImplement.
 *   - diopiRotaryEmbedding: x [..., D], D even; cos and sin broadcast (numpy rules) to x's shape with the last dim
 *     halved (DIOPI's torch implementation: x split into halves, or pairs when interleaved).
 *   - diopiFlashAttention: q [B,Tq,H,D], k and v [B,Tk,Hk,D(v)] with H % Hk == 0 (grouped queries); a causal mask
 *     and sliding windows are aligned to the bottom right (key j is visible to query i when j <= i + Tk - Tq), as
 *     in FlashAttention 2; a row with no visible key gets out 0 and lse +inf. softmax_lse is [B,H,Tq]. No dropout
 *     (p_dropout != 0 -> NoImplement), no ALiBi. The backward, as FlashAttention's, takes the probabilities from
 *     softmax_lse (P = exp(scale q.k - lse)) and the row term from attention_out (sum(dO * O)); either may be null,
 *     and is then recomputed from q, k and v.
 *   - diopiCrossEntropyLoss: class-index targets only (probability targets -> NoImplement), label_smoothing 0.
 *   - diopiEmbeddingBackward: sparse -> NoImplement; padding_idx < 0 means none.
 *
 * Test-only variants (compile definitions):
 *   DIOPI_SAMPLE_WRONG_SOFTMAX  diopiSoftmax leaves the last element out of each row's sum when the row length
 *                               % 8 == 5: right for most shapes, so only a suite that tries such lengths catches it;
 *   DIOPI_SAMPLE_PARTIAL        no diopiLayerNorm / diopiLayerNormBackward symbols at all, diopiMm answers
 *                               diopiDtypeNotSupported for float64, and diopiGeluBackward always answers
 *                               diopiForceFallbackToCPU: the framework's per-call fallback must take over.
 *   DIOPI_SAMPLE_NAME="..."     the vendor name diopiGetVendorName reports.
 */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <diopi/diopirt.h>
#include <diopi/functions.h>
#include <diopi/functions_ext.h>

#ifndef DIOPI_SAMPLE_NAME
#define DIOPI_SAMPLE_NAME "diopi_sample"
#endif

/* ---- Naming and errors ---------------------------------------------------------------------------------------- */

static _Thread_local char last_error[512];

static diopiError_t fail(diopiError_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static diopiError_t fail(diopiError_t code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

const char* diopiGetVendorName(void) { return DIOPI_SAMPLE_NAME; }
const char* diopiGetImplVersion(void) { return "diopi_sample 1.0 (host, float16/bfloat16/float32/float64)"; }
const char* diopiGetLastErrorString(void) { return last_error; }
const char* diopiGetVersion(void) {
  static char version[64];
  snprintf(version, sizeof version, "DIOPI Version: %d.%d.%d", DIOPI_VER_MAJOR, DIOPI_VER_MINOR, DIOPI_VER_PATCH);
  return version;
}

#define CHECK(expr)                       \
  do {                                    \
    diopiError_t check_status_ = (expr);  \
    if (check_status_ != diopiSuccess) return check_status_; \
  } while (0)

/* ---- Tensor views: data, dtype, shape and strides read once through diopirt ------------------------------------ */

enum { MAXD = 8 };

typedef struct {
  char* p; /* the first element; writable for outputs (the runtime hands out one pointer for both) */
  diopiDtype_t dt;
  int64_t esz;
  int nd;
  int64_t shape[MAXD];
  int64_t stride[MAXD]; /* in elements */
  int64_t numel;
} View;

static int64_t dtype_size(diopiDtype_t dt) {
  switch (dt) {
    case diopi_dtype_int8: case diopi_dtype_uint8: case diopi_dtype_bool: return 1;
    case diopi_dtype_int16: case diopi_dtype_uint16: case diopi_dtype_float16: case diopi_dtype_bfloat16: return 2;
    case diopi_dtype_int32: case diopi_dtype_uint32: case diopi_dtype_float32: return 4;
    case diopi_dtype_int64: case diopi_dtype_uint64: case diopi_dtype_float64: return 8;
    default: return 0;
  }
}

static bool is_float(diopiDtype_t dt) {
  return dt == diopi_dtype_float16 || dt == diopi_dtype_bfloat16 || dt == diopi_dtype_float32 ||
         dt == diopi_dtype_float64;
}
static bool is_index(diopiDtype_t dt) { return dt == diopi_dtype_int32 || dt == diopi_dtype_int64; }

static diopiError_t view_of(diopiConstTensorHandle_t t, const char* fn, const char* what, View* v) {
  if (!t) return fail(diopiErrorOccurred, "%s: %s is null", fn, what);
  diopiDevice_t dev = diopi_host;
  if (diopiGetTensorDevice && diopiGetTensorDevice(t, &dev) != diopiSuccess)
    return fail(diopiErrorOccurred, "%s: diopiGetTensorDevice failed for %s", fn, what);
  if (dev != diopi_host)
    return fail(diopiNoImplement, "%s: %s is a device tensor; diopi_sample computes on the host only", fn, what);
  diopiSize_t shape, stride;
  if (diopiGetTensorShape(t, &shape) != diopiSuccess || diopiGetTensorStride(t, &stride) != diopiSuccess ||
      diopiGetTensorDtype(t, &v->dt) != diopiSuccess)
    return fail(diopiErrorOccurred, "%s: the runtime could not describe %s", fn, what);
  if (shape.len > MAXD) return fail(diopiNoImplement, "%s: %s has %lld dims (at most %d)", fn, what, (long long)shape.len, MAXD);
  v->esz = dtype_size(v->dt);
  if (!v->esz) return fail(diopiDtypeNotSupported, "%s: %s has dtype %d, which diopi_sample does not read", fn, what, (int)v->dt);
  v->nd = (int)shape.len;
  v->numel = 1;
  for (int d = v->nd - 1; d >= 0; --d) {
    if (shape.data[d] < 0) return fail(diopiErrorOccurred, "%s: %s has a negative size", fn, what);
    v->shape[d] = shape.data[d];
    /* A runtime that reports no strides describes a contiguous tensor. */
    v->stride[d] = stride.len == shape.len ? stride.data[d] : (d == v->nd - 1 ? 1 : v->stride[d + 1] * v->shape[d + 1]);
    v->numel *= v->shape[d];
  }
  const void* data = NULL;
  if (diopiGetTensorDataConst(t, &data) != diopiSuccess)
    return fail(diopiErrorOccurred, "%s: diopiGetTensorDataConst failed for %s", fn, what);
  if (!data && v->numel > 0) return fail(diopiErrorOccurred, "%s: %s has no data", fn, what);
  v->p = (char*)data;
  return diopiSuccess;
}

/* An optional tensor: null handle -> present = false. */
static diopiError_t opt_view(diopiConstTensorHandle_t t, const char* fn, const char* what, View* v, bool* present) {
  *present = t != NULL;
  return t ? view_of(t, fn, what, v) : diopiSuccess;
}

static diopiError_t need_float(const View* v, const char* fn, const char* what) {
  return is_float(v->dt) ? diopiSuccess
                         : fail(diopiDtypeNotSupported, "%s: %s has dtype %d; diopi_sample serves float16, bfloat16, "
                                "float32 and float64 here", fn, what, (int)v->dt);
}

static bool same_shape(const View* a, const View* b) {
  if (a->nd != b->nd) return false;
  for (int d = 0; d < a->nd; ++d)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

static void shape_str(const View* v, char* buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int d = 0; d < v->nd && k < n; ++d) k += (size_t)snprintf(buf + k, n - k, d ? ",%lld" : "%lld", (long long)v->shape[d]);
  if (k < n) snprintf(buf + k, n - k, "]");
}

static diopiError_t need_same_shape(const View* a, const View* b, const char* fn, const char* wa, const char* wb) {
  if (same_shape(a, b)) return diopiSuccess;
  char sa[128], sb[128];
  shape_str(a, sa, sizeof sa);
  shape_str(b, sb, sizeof sb);
  return fail(diopiErrorOccurred, "%s: %s %s and %s %s must have the same shape", fn, wa, sa, wb, sb);
}

static int norm_dim(int64_t dim, int nd) { return (int)(dim < 0 ? dim + (nd ? nd : 1) : dim); }

/* ---- Element access ------------------------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (!man) {
      u = sign;
    } else { /* subnormal: renormalize */
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t float_to_half(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t au = u & 0x7fffffffu;
  if (au >= 0x7f800000u) return sign | 0x7c00 | (au > 0x7f800000u ? 0x200 : 0); /* inf / nan */
  if (au >= 0x477ff000u) return sign | 0x7c00;                                  /* rounds past 65504: inf */
  if (au < 0x38800000u) {                                                       /* subnormal half or zero */
    if (au < 0x33000000u) return sign;
    /* value = man * 2^(e - 150); half subnormals count units of 2^-24, so shift by 126 - e (14..24) */
    uint32_t man = (au & 0x7fffff) | 0x800000;
    int s = 126 - (int)(au >> 23);
    uint32_t r = man >> s, rem = man & ((1u << s) - 1);
    uint32_t halfway = 1u << (s - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) ++r;
    return sign | (uint16_t)r;
  }
  uint32_t r = au + 0x0fff + ((au >> 13) & 1); /* round to nearest even on the 13 dropped bits */
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

static float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* keep nan a nan */
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static double ld(const View* v, int64_t off) {
  const char* q = v->p + off * v->esz;
  switch (v->dt) {
    case diopi_dtype_float32: { float x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_float64: { double x; memcpy(&x, q, 8); return x; }
    case diopi_dtype_float16: { uint16_t x; memcpy(&x, q, 2); return half_to_float(x); }
    case diopi_dtype_bfloat16: { uint16_t x; memcpy(&x, q, 2); return bf16_to_float(x); }
    case diopi_dtype_int8: return *(const int8_t*)q;
    case diopi_dtype_uint8: return *(const uint8_t*)q;
    case diopi_dtype_bool: return *(const uint8_t*)q != 0;
    case diopi_dtype_int16: { int16_t x; memcpy(&x, q, 2); return x; }
    case diopi_dtype_uint16: { uint16_t x; memcpy(&x, q, 2); return x; }
    case diopi_dtype_int32: { int32_t x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_uint32: { uint32_t x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_int64: { int64_t x; memcpy(&x, q, 8); return (double)x; }
    case diopi_dtype_uint64: { uint64_t x; memcpy(&x, q, 8); return (double)x; }
    default: return NAN;
  }
}

/* Integers keep all 64 bits on their own path (a double would round int64 values past 2^53). */
static int64_t ld_i64(const View* v, int64_t off) {
  const char* q = v->p + off * v->esz;
  switch (v->dt) {
    case diopi_dtype_int64: { int64_t x; memcpy(&x, q, 8); return x; }
    case diopi_dtype_uint64: { uint64_t x; memcpy(&x, q, 8); return (int64_t)x; }
    case diopi_dtype_int32: { int32_t x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_uint32: { uint32_t x; memcpy(&x, q, 4); return x; }
    default: return (int64_t)ld(v, off);
  }
}

static void st(const View* v, int64_t off, double x) {
  char* q = v->p + off * v->esz;
  switch (v->dt) {
    case diopi_dtype_float32: { float y = (float)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_float64: memcpy(q, &x, 8); break;
    case diopi_dtype_float16: { uint16_t y = float_to_half((float)x); memcpy(q, &y, 2); break; }
    case diopi_dtype_bfloat16: { uint16_t y = float_to_bf16((float)x); memcpy(q, &y, 2); break; }
    case diopi_dtype_bool: *(uint8_t*)q = x != 0; break;
    case diopi_dtype_int8: *(int8_t*)q = (int8_t)(int64_t)x; break;
    case diopi_dtype_uint8: *(uint8_t*)q = (uint8_t)(int64_t)x; break;
    case diopi_dtype_int16: { int16_t y = (int16_t)(int64_t)x; memcpy(q, &y, 2); break; }
    case diopi_dtype_uint16: { uint16_t y = (uint16_t)(int64_t)x; memcpy(q, &y, 2); break; }
    case diopi_dtype_int32: { int32_t y = (int32_t)(int64_t)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_uint32: { uint32_t y = (uint32_t)(int64_t)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_int64: { int64_t y = (int64_t)x; memcpy(q, &y, 8); break; }
    case diopi_dtype_uint64: { uint64_t y = (uint64_t)(int64_t)x; memcpy(q, &y, 8); break; }
    default: break;
  }
}

static void st_i64(const View* v, int64_t off, int64_t x) {
  char* q = v->p + off * v->esz;
  switch (v->dt) {
    case diopi_dtype_int64: case diopi_dtype_uint64: memcpy(q, &x, 8); break;
    case diopi_dtype_int32: case diopi_dtype_uint32: { int32_t y = (int32_t)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_int16: case diopi_dtype_uint16: { int16_t y = (int16_t)x; memcpy(q, &y, 2); break; }
    case diopi_dtype_int8: case diopi_dtype_uint8: *(int8_t*)q = (int8_t)x; break;
    case diopi_dtype_bool: *(uint8_t*)q = x != 0; break;
    default: st(v, off, (double)x); break;
  }
}

/* ---- Iteration: an odometer over a shape, carrying the element offset of up to 6 views ------------------------- */

enum { MAXV = 6 };

typedef struct {
  int nd, nv;
  int64_t shape[MAXD], idx[MAXD];
  int64_t stride[MAXV][MAXD];
  int64_t off[MAXV];
} Iter;

/* Walks `shape` (the shape of vs[0]) in row-major order; every view must have that many dims. */
static void it_init(Iter* it, const View* const* vs, int nv) {
  it->nd = vs[0]->nd;
  it->nv = nv;
  for (int d = 0; d < it->nd; ++d) {
    it->shape[d] = vs[0]->shape[d];
    it->idx[d] = 0;
    for (int k = 0; k < nv; ++k) it->stride[k][d] = vs[k]->stride[d];
  }
  for (int k = 0; k < nv; ++k) it->off[k] = 0;
}

static void it_next(Iter* it) {
  for (int d = it->nd - 1; d >= 0; --d) {
    for (int k = 0; k < it->nv; ++k) it->off[k] += it->stride[k][d];
    if (++it->idx[d] < it->shape[d]) return;
    for (int k = 0; k < it->nv; ++k) it->off[k] -= it->stride[k][d] * it->shape[d];
    it->idx[d] = 0;
  }
}

/* `in` seen with `out`'s shape (numpy broadcasting: stride 0 where in has size 1 or lacks the dim). */
static diopiError_t broadcast_to(const View* in, const View* out, View* r, const char* fn, const char* what) {
  char si[128], so[128];
  *r = *in;
  r->nd = out->nd;
  r->numel = out->numel;
  if (in->nd > out->nd) goto bad;
  for (int d = out->nd - 1; d >= 0; --d) {
    int di = d - (out->nd - in->nd);
    r->shape[d] = out->shape[d];
    if (di < 0) r->stride[d] = 0;
    else if (in->shape[di] == out->shape[d]) r->stride[d] = in->stride[di];
    else if (in->shape[di] == 1) r->stride[d] = 0;
    else goto bad;
  }
  return diopiSuccess;
bad:
  shape_str(in, si, sizeof si);
  shape_str(out, so, sizeof so);
  return fail(diopiErrorOccurred, "%s: %s %s does not broadcast to the output's shape %s", fn, what, si, so);
}

static void swap_dims(View* v, int a, int b) {
  int64_t s = v->shape[a], t = v->stride[a];
  v->shape[a] = v->shape[b], v->stride[a] = v->stride[b];
  v->shape[b] = s, v->stride[b] = t;
}

/* Moves dim `d` to the end (the others keep their order). */
static void move_dim_last(View* v, int d) {
  for (int k = d; k + 1 < v->nd; ++k) swap_dims(v, k, k + 1);
}

/* The sub-view of dims [first, first + count). */
static View dims_of(const View* v, int first, int count) {
  View r = *v;
  r.nd = count;
  r.numel = 1;
  for (int d = 0; d < count; ++d) {
    r.shape[d] = v->shape[first + d];
    r.stride[d] = v->stride[first + d];
    r.numel *= r.shape[d];
  }
  return r;
}

/* ---- Scratch memory from the framework ------------------------------------------------------------------------ */

/* Scratch lives until the call returns (the framework owns it): diopiRequireBuffer, or a float64 tensor from
 * diopiRequireTensor when the runtime lacks the weak diopiRequireBuffer. */
static diopiError_t scratch(diopiContextHandle_t ctx, int64_t count, const char* fn, double** out) {
  if (count < 1) count = 1;
  diopiTensorHandle_t t = NULL;
  diopiError_t s;
  if (diopiRequireBuffer) {
    s = diopiRequireBuffer(ctx, &t, count * (int64_t)sizeof(double), diopi_host);
  } else {
    int64_t n = count, one = 1;
    diopiSize_t size = {&n, 1}, stride = {&one, 1};
    s = diopiRequireTensor(ctx, &t, &size, &stride, diopi_dtype_float64, diopi_host);
  }
  void* p = NULL;
  if (s != diopiSuccess || !t || diopiGetTensorData(t, &p) != diopiSuccess || !p)
    return fail(diopiErrorOccurred, "%s: the runtime could not provide %lld bytes of scratch", fn,
                (long long)(count * (int64_t)sizeof(double)));
  *out = (double*)p;
  return diopiSuccess;
}

/* Reads a view in row-major order into dst (float64). */
static void pack(const View* v, double* dst) {
  if (v->numel == 0) return;
  const View* vs[1] = {v};
  Iter it;
  it_init(&it, vs, 1);
  for (int64_t i = 0; i < v->numel; ++i, it_next(&it)) dst[i] = ld(v, it.off[0]);
}

/* Writes src (row-major) into a view. */
static void unpack(const View* v, const double* src) {
  if (v->numel == 0) return;
  const View* vs[1] = {v};
  Iter it;
  it_init(&it, vs, 1);
  for (int64_t i = 0; i < v->numel; ++i, it_next(&it)) st(v, it.off[0], src[i]);
}

static diopiError_t packed(diopiContextHandle_t ctx, const View* v, const char* fn, double** out) {
  CHECK(scratch(ctx, v->numel, fn, out));
  pack(v, *out);
  return diopiSuccess;
}

static double dot(const double* a, const double* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    s0 += a[k] * b[k];
    s1 += a[k + 1] * b[k + 1];
    s2 += a[k + 2] * b[k + 2];
    s3 += a[k + 3] * b[k + 3];
  }
  for (; k < n; ++k) s0 += a[k] * b[k];
  return (s0 + s1) + (s2 + s3);
}

/* C[i][j] = sum_k A[i][k] B[j][k]: A is M x K, B is N x K, both row-major (the second factor transposed). */
static void gemm_nt(const double* a, const double* b, int64_t m, int64_t n, int64_t k, double* c) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * n + j] = dot(a + i * k, b + j * k, k);
}

static void transpose(const double* a, int64_t rows, int64_t cols, double* t) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
}

static double scalar_value(const diopiScalar_t* s, double dflt) {
  if (!s) return dflt;
  return is_float(s->stype) || s->stype == diopi_dtype_tfloat32 ? s->fval : (double)s->ival;
}

/* ---- Matrix products ------------------------------------------------------------------------------------------ */

/* out[b] = alpha * A[b] B[b] + beta * C (C broadcast to out, not read when beta == 0, as in PyTorch). A is
 * [batch, M, K], B [batch, K, N], out [batch, M, N] (batch 1 for the 2-D functions, given as 3-D views). */
static diopiError_t batched_matmul(diopiContextHandle_t ctx, const char* fn, const View* out, const View* a,
                                   const View* b, const View* c, double alpha, double beta) {
  const int64_t batch = out->shape[0], m = out->shape[1], n = out->shape[2], k = a->shape[2];
  double *pa, *pb, *pc;
  View bt = *b;
  swap_dims(&bt, 1, 2); /* pack B transposed: [batch, N, K] */
  CHECK(packed(ctx, a, fn, &pa));
  CHECK(packed(ctx, &bt, fn, &pb));
  CHECK(scratch(ctx, out->numel, fn, &pc));
  for (int64_t i = 0; i < batch; ++i) gemm_nt(pa + i * m * k, pb + i * n * k, m, n, k, pc + i * m * n);
  const View* vs[2] = {out, c ? c : out};
  Iter it;
  it_init(&it, vs, c ? 2 : 1);
  for (int64_t i = 0; i < out->numel; ++i, it_next(&it)) {
    double y = alpha * pc[i];
    if (c && beta != 0) y += beta * ld(c, it.off[1]);
    st(out, it.off[0], y);
  }
  return diopiSuccess;
}

static View as_batch1(const View* v) { /* [M, N] -> [1, M, N] */
  View r = *v;
  r.nd = 3;
  r.shape[0] = 1, r.stride[0] = 0;
  for (int d = 0; d < 2; ++d) r.shape[d + 1] = v->shape[d], r.stride[d + 1] = v->stride[d];
  return r;
}

static diopiError_t check_matmul(const char* fn, const View* out, const View* a, const View* b, int nd) {
  CHECK(need_float(a, fn, "input"));
  CHECK(need_float(b, fn, "mat2"));
  CHECK(need_float(out, fn, "out"));
  if (a->nd != nd || b->nd != nd || out->nd != nd)
    return fail(diopiErrorOccurred, "%s: input, mat2 and out must be %d-D (got %d, %d, %d)", fn, nd, a->nd, b->nd, out->nd);
  const int r = nd - 2;
  if (a->shape[r + 1] != b->shape[r] || out->shape[r] != a->shape[r] || out->shape[r + 1] != b->shape[r + 1] ||
      (nd == 3 && (a->shape[0] != b->shape[0] || out->shape[0] != a->shape[0]))) {
    char sa[128], sb[128], so[128];
    shape_str(a, sa, sizeof sa);
    shape_str(b, sb, sizeof sb);
    shape_str(out, so, sizeof so);
    return fail(diopiErrorOccurred, "%s: shapes do not multiply: input %s, mat2 %s, out %s", fn, sa, sb, so);
  }
  return diopiSuccess;
}

diopiError_t diopiMm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                     diopiConstTensorHandle_t mat2) {
  const char* fn = "diopiMm";
  View o, a, b;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &a));
  CHECK(view_of(mat2, fn, "mat2", &b));
#ifdef DIOPI_SAMPLE_PARTIAL
  if (a.dt == diopi_dtype_float64)
    return fail(diopiDtypeNotSupported, "diopiMm: this partial build does not serve float64");
#endif
  CHECK(check_matmul(fn, &o, &a, &b, 2));
  View o3 = as_batch1(&o), a3 = as_batch1(&a), b3 = as_batch1(&b);
  return batched_matmul(ctx, fn, &o3, &a3, &b3, NULL, 1, 0);
}

diopiError_t diopiBmm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                      diopiConstTensorHandle_t mat2) {
  const char* fn = "diopiBmm";
  View o, a, b;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &a));
  CHECK(view_of(mat2, fn, "mat2", &b));
  CHECK(check_matmul(fn, &o, &a, &b, 3));
  return batched_matmul(ctx, fn, &o, &a, &b, NULL, 1, 0);
}

diopiError_t diopiAddmm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                        diopiConstTensorHandle_t mat1, diopiConstTensorHandle_t mat2, const diopiScalar_t* beta,
                        const diopiScalar_t* alpha) {
  const char* fn = "diopiAddmm";
  View o, c, a, b, cb;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &c));
  CHECK(view_of(mat1, fn, "mat1", &a));
  CHECK(view_of(mat2, fn, "mat2", &b));
  CHECK(check_matmul(fn, &o, &a, &b, 2));
  CHECK(need_float(&c, fn, "input"));
  CHECK(broadcast_to(&c, &o, &cb, fn, "input"));
  View o3 = as_batch1(&o), a3 = as_batch1(&a), b3 = as_batch1(&b), c3 = as_batch1(&cb);
  return batched_matmul(ctx, fn, &o3, &a3, &b3, &c3, scalar_value(alpha, 1), scalar_value(beta, 1));
}

diopiError_t diopiBaddbmm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                          diopiConstTensorHandle_t batch1, diopiConstTensorHandle_t batch2, double beta, double alpha) {
  const char* fn = "diopiBaddbmm";
  View o, c, a, b, cb;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &c));
  CHECK(view_of(batch1, fn, "batch1", &a));
  CHECK(view_of(batch2, fn, "batch2", &b));
  CHECK(check_matmul(fn, &o, &a, &b, 3));
  CHECK(need_float(&c, fn, "input"));
  CHECK(broadcast_to(&c, &o, &cb, fn, "input"));
  return batched_matmul(ctx, fn, &o, &a, &b, &cb, alpha, beta);
}

/* input [..., I] seen as rows [R, I]; `last` is its size. */
static diopiError_t rows_of(const View* v, const char* fn, const char* what, int64_t* rows, int64_t* last) {
  if (v->nd < 1) return fail(diopiErrorOccurred, "%s: %s must have at least 1 dim", fn, what);
  *last = v->shape[v->nd - 1];
  *rows = *last ? v->numel / *last : 0;
  if (!*last) { /* numel is 0: count rows from the leading dims */
    *rows = 1;
    for (int d = 0; d + 1 < v->nd; ++d) *rows *= v->shape[d];
  }
  return diopiSuccess;
}

diopiError_t diopiLinear(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                         diopiConstTensorHandle_t weight, diopiConstTensorHandle_t bias) {
  const char* fn = "diopiLinear";
  View o, x, w, bv;
  bool has_bias;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(view_of(weight, fn, "weight", &w));
  CHECK(opt_view(bias, fn, "bias", &bv, &has_bias));
  CHECK(need_float(&x, fn, "input"));
  CHECK(need_float(&w, fn, "weight"));
  CHECK(need_float(&o, fn, "out"));
  int64_t rows, in_f, out_rows, out_f;
  CHECK(rows_of(&x, fn, "input", &rows, &in_f));
  CHECK(rows_of(&o, fn, "out", &out_rows, &out_f));
  if (w.nd != 2 || w.shape[1] != in_f || w.shape[0] != out_f || out_rows != rows || o.nd != x.nd)
    return fail(diopiErrorOccurred, "%s: weight must be [out_features, in_features] = [%lld, %lld] and out "
                "input's leading dims by out_features", fn, (long long)out_f, (long long)in_f);
  if (has_bias && bv.numel != out_f)
    return fail(diopiErrorOccurred, "%s: bias has %lld elements, expected out_features = %lld", fn,
                (long long)bv.numel, (long long)out_f);
  double *px, *pw, *py, *pb = NULL;
  CHECK(packed(ctx, &x, fn, &px));
  CHECK(packed(ctx, &w, fn, &pw));
  if (has_bias) CHECK(packed(ctx, &bv, fn, &pb));
  CHECK(scratch(ctx, rows * out_f, fn, &py));
  gemm_nt(px, pw, rows, out_f, in_f, py);
  if (pb)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < out_f; ++j) py[r * out_f + j] += pb[j];
  unpack(&o, py);
  return diopiSuccess;
}

diopiError_t diopiLinearBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                 diopiTensorHandle_t grad_weight, diopiTensorHandle_t grad_bias,
                                 diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                                 diopiConstTensorHandle_t weight) {
  const char* fn = "diopiLinearBackward";
  View g, x, w, gi, gw, gb;
  bool want_gi, want_gw, want_gb;
  CHECK(view_of(grad_output, fn, "grad_output", &g));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(view_of(weight, fn, "weight", &w));
  CHECK(opt_view(grad_input, fn, "grad_input", &gi, &want_gi));
  CHECK(opt_view(grad_weight, fn, "grad_weight", &gw, &want_gw));
  CHECK(opt_view(grad_bias, fn, "grad_bias", &gb, &want_gb));
  CHECK(need_float(&g, fn, "grad_output"));
  CHECK(need_float(&x, fn, "input"));
  CHECK(need_float(&w, fn, "weight"));
  int64_t rows, in_f, grows, out_f;
  CHECK(rows_of(&x, fn, "input", &rows, &in_f));
  CHECK(rows_of(&g, fn, "grad_output", &grows, &out_f));
  if (w.nd != 2 || w.shape[0] != out_f || w.shape[1] != in_f || grows != rows)
    return fail(diopiErrorOccurred, "%s: grad_output [..., %lld], input [..., %lld] and weight must agree", fn,
                (long long)out_f, (long long)in_f);
  if (want_gi) CHECK(need_same_shape(&gi, &x, fn, "grad_input", "input"));
  if (want_gw) CHECK(need_same_shape(&gw, &w, fn, "grad_weight", "weight"));
  if (want_gb && gb.numel != out_f)
    return fail(diopiErrorOccurred, "%s: grad_bias has %lld elements, expected %lld", fn, (long long)gb.numel,
                (long long)out_f);
  double* pg;
  CHECK(packed(ctx, &g, fn, &pg));
  if (want_gi) { /* grad_input = G W: [R, O] x [O, I] */
    View wt = w;
    swap_dims(&wt, 0, 1);
    double *pwt, *pgi;
    CHECK(packed(ctx, &wt, fn, &pwt));
    CHECK(scratch(ctx, rows * in_f, fn, &pgi));
    gemm_nt(pg, pwt, rows, in_f, out_f, pgi);
    unpack(&gi, pgi);
  }
  if (want_gw) { /* grad_weight = G^T X: [O, R] x [R, I] */
    double *px, *pgt, *pxt, *pgw;
    CHECK(packed(ctx, &x, fn, &px));
    CHECK(scratch(ctx, rows * out_f, fn, &pgt));
    CHECK(scratch(ctx, rows * in_f, fn, &pxt));
    CHECK(scratch(ctx, out_f * in_f, fn, &pgw));
    transpose(pg, rows, out_f, pgt);
    transpose(px, rows, in_f, pxt);
    gemm_nt(pgt, pxt, out_f, in_f, rows, pgw);
    unpack(&gw, pgw);
  }
  if (want_gb) {
    double* pgb;
    CHECK(scratch(ctx, out_f, fn, &pgb));
    for (int64_t j = 0; j < out_f; ++j) pgb[j] = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < out_f; ++j) pgb[j] += pg[r * out_f + j];
    unpack(&gb, pgb);
  }
  return diopiSuccess;
}

/* ---- Elementwise arithmetic, fill, copy, cast, sum ------------------------------------------------------------ */

static bool is_integral(diopiDtype_t dt) { return !is_float(dt) && dtype_size(dt) != 0; }

/* out = f(in0 [, in1]) with in0/in1 broadcast to out; kind 0: a + alpha * b, kind 1: a * b. b may be a scalar. */
static diopiError_t binary(const char* fn, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                           diopiConstTensorHandle_t other, const diopiScalar_t* other_scalar, double alpha, int kind) {
  View o, a, b, ab, bb;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &a));
  CHECK(broadcast_to(&a, &o, &ab, fn, "input"));
  if (other) {
    CHECK(view_of(other, fn, "other", &b));
    CHECK(broadcast_to(&b, &o, &bb, fn, "other"));
  } else if (!other_scalar) {
    return fail(diopiErrorOccurred, "%s: other is null", fn);
  }
  if (!o.numel) return diopiSuccess;
  const View* vs[3] = {&o, &ab, other ? &bb : &o};
  Iter it;
  it_init(&it, vs, other ? 3 : 2);
  const bool ints = is_integral(o.dt) && o.dt != diopi_dtype_bool && is_integral(a.dt) &&
                    (other ? is_integral(b.dt) : !is_float(other_scalar->stype)) && alpha == (double)(int64_t)alpha;
  const int64_t sb_i = other ? 0 : (int64_t)scalar_value(other_scalar, 0);
  const double sb = other ? 0 : scalar_value(other_scalar, 0);
  for (int64_t i = 0; i < o.numel; ++i, it_next(&it)) {
    if (ints) { /* exact 64-bit integer arithmetic */
      int64_t x = ld_i64(&ab, it.off[1]), y = other ? ld_i64(&bb, it.off[2]) : sb_i;
      st_i64(&o, it.off[0], kind == 0 ? x + (int64_t)alpha * y : x * y);
    } else {
      double x = ld(&ab, it.off[1]), y = other ? ld(&bb, it.off[2]) : sb;
      st(&o, it.off[0], kind == 0 ? x + alpha * y : x * y);
    }
  }
  return diopiSuccess;
}

diopiError_t diopiAdd(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                      diopiConstTensorHandle_t other, const diopiScalar_t* alpha) {
  (void)ctx;
  if (!other) return fail(diopiErrorOccurred, "diopiAdd: other is null");
  return binary("diopiAdd", out, input, other, NULL, scalar_value(alpha, 1), 0);
}

diopiError_t diopiAddScalar(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                            const diopiScalar_t* other, const diopiScalar_t* alpha) {
  (void)ctx;
  return binary("diopiAddScalar", out, input, NULL, other, scalar_value(alpha, 1), 0);
}

diopiError_t diopiMul(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                      diopiConstTensorHandle_t other) {
  (void)ctx;
  if (!other) return fail(diopiErrorOccurred, "diopiMul: other is null");
  return binary("diopiMul", out, input, other, NULL, 1, 1);
}

diopiError_t diopiMulScalar(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                            const diopiScalar_t* other) {
  (void)ctx;
  return binary("diopiMulScalar", out, input, NULL, other, 1, 1);
}

diopiError_t diopiFill(diopiContextHandle_t ctx, diopiTensorHandle_t input, const diopiScalar_t* value) {
  (void)ctx;
  const char* fn = "diopiFill";
  View v;
  CHECK(view_of(input, fn, "input", &v));
  if (!value) return fail(diopiErrorOccurred, "%s: value is null", fn);
  if (!v.numel) return diopiSuccess;
  const bool ints = is_integral(v.dt) && !is_float(value->stype);
  const View* vs[1] = {&v};
  Iter it;
  it_init(&it, vs, 1);
  for (int64_t i = 0; i < v.numel; ++i, it_next(&it)) {
    if (ints) st_i64(&v, it.off[0], value->ival);
    else st(&v, it.off[0], scalar_value(value, 0));
  }
  return diopiSuccess;
}

/* Bytes a view touches, [lo, hi). */
static void extent(const View* v, const char** lo, const char** hi) {
  int64_t mn = 0, mx = 0;
  for (int d = 0; d < v->nd; ++d) {
    if (!v->shape[d]) { *lo = *hi = v->p; return; }
    int64_t span = (v->shape[d] - 1) * v->stride[d];
    if (span < 0) mn += span; else mx += span;
  }
  *lo = v->p + mn * v->esz;
  *hi = v->p + (mx + 1) * v->esz;
}

/* dst = src converted to dst's dtype, src broadcast to dst's shape. Overlapping memory goes through scratch. */
static diopiError_t convert(diopiContextHandle_t ctx, const char* fn, const View* dst, const View* src) {
  View sb;
  CHECK(broadcast_to(src, dst, &sb, fn, "src"));
  if (!dst->numel) return diopiSuccess;
  const char *slo, *shi, *dlo, *dhi;
  extent(src, &slo, &shi);
  extent(dst, &dlo, &dhi);
  const bool overlap = slo < dhi && dlo < shi && !(src->p == dst->p && same_shape(src, dst) &&
                                                   !memcmp(src->stride, dst->stride, sizeof(int64_t) * src->nd));
  const bool ints = is_integral(src->dt) && is_integral(dst->dt);
  double* tmp = NULL;
  if (overlap) {
    CHECK(scratch(ctx, dst->numel, fn, &tmp));
    const View* vs[1] = {&sb};
    Iter it;
    it_init(&it, vs, 1);
    for (int64_t i = 0; i < dst->numel; ++i, it_next(&it)) {
      if (ints) { int64_t x = ld_i64(&sb, it.off[0]); memcpy(&tmp[i], &x, 8); }
      else tmp[i] = ld(&sb, it.off[0]);
    }
  }
  const View* vs[2] = {dst, &sb};
  Iter it;
  it_init(&it, vs, 2);
  for (int64_t i = 0; i < dst->numel; ++i, it_next(&it)) {
    if (ints) {
      int64_t x;
      if (tmp) memcpy(&x, &tmp[i], 8); else x = ld_i64(&sb, it.off[1]);
      st_i64(dst, it.off[0], x);
    } else {
      st(dst, it.off[0], tmp ? tmp[i] : ld(&sb, it.off[1]));
    }
  }
  return diopiSuccess;
}

diopiError_t diopiCopyInp(diopiContextHandle_t ctx, diopiConstTensorHandle_t src, diopiTensorHandle_t dest) {
  const char* fn = "diopiCopyInp";
  View s, d;
  CHECK(view_of(src, fn, "src", &s));
  CHECK(view_of(dest, fn, "dest", &d));
  return convert(ctx, fn, &d, &s);
}

diopiError_t diopiCastDtype(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input) {
  const char* fn = "diopiCastDtype";
  View o, x;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(need_same_shape(&o, &x, fn, "out", "input"));
  return convert(ctx, fn, &o, &x);
}

diopiError_t diopiSum(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                      diopiSize_t dim) {
  const char* fn = "diopiSum";
  View o, x;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  bool reduced[MAXD] = {false};
  if (dim.len == 0) { /* no dims: reduce all, as torch.sum(x) */
    for (int d = 0; d < x.nd; ++d) reduced[d] = true;
  }
  for (int64_t i = 0; i < dim.len; ++i) {
    int d = norm_dim(dim.data[i], x.nd);
    if (d < 0 || d >= (x.nd ? x.nd : 1))
      return fail(diopiErrorOccurred, "%s: dim %lld is out of range for a %d-D input", fn, (long long)dim.data[i], x.nd);
    if (x.nd) reduced[d] = true;
  }
  /* out's elements are the kept dims in row-major order, whether out keeps the reduced dims as 1s or not. */
  int64_t kept = 1;
  View key = x; /* x's shape with the reduced dims' strides in "out element" units zeroed */
  for (int d = x.nd - 1; d >= 0; --d) {
    key.stride[d] = reduced[d] ? 0 : kept;
    if (!reduced[d]) kept *= x.shape[d];
  }
  if (o.numel != kept)
    return fail(diopiErrorOccurred, "%s: out has %lld elements, expected %lld (the kept dims)", fn,
                (long long)o.numel, (long long)kept);
  double* acc;
  CHECK(scratch(ctx, kept, fn, &acc));
  for (int64_t i = 0; i < kept; ++i) acc[i] = 0;
  if (x.numel) {
    const View* vs[2] = {&x, &key};
    Iter it;
    it_init(&it, vs, 2);
    for (int64_t i = 0; i < x.numel; ++i, it_next(&it)) acc[it.off[1]] += ld(&x, it.off[0]);
  }
  unpack(&o, acc);
  return diopiSuccess;
}

/* ---- Softmax family ------------------------------------------------------------------------------------------- */

/* Walks the rows of `dim` across n same-shaped views: each step gives the offset of a row's first element in each
 * view; the row's elements follow at the view's stride along dim. */
typedef struct {
  Iter it;
  int64_t rows, len, step[MAXV];
} Rows;

static void rows_init(Rows* r, const View* const* vs, int n, int dim) {
  View collapsed[MAXV];
  const View* cp[MAXV];
  for (int k = 0; k < n; ++k) {
    collapsed[k] = *vs[k];
    if (vs[k]->nd == 0) { /* a 0-d tensor is one row of one element */
      collapsed[k].nd = 1, collapsed[k].shape[0] = 1, collapsed[k].stride[0] = 1;
    }
    r->step[k] = collapsed[k].stride[dim];
    collapsed[k].shape[dim] = 1;
    cp[k] = &collapsed[k];
  }
  r->len = vs[0]->nd ? vs[0]->shape[dim] : 1;
  r->rows = r->len ? vs[0]->numel / r->len : 0;
  it_init(&r->it, cp, n);
}

static diopiError_t softmax_args(const char* fn, const View* a, const View* b, int64_t dim, int* d, const char* wa,
                                 const char* wb) {
  CHECK(need_float(a, fn, wa));
  CHECK(need_float(b, fn, wb));
  CHECK(need_same_shape(a, b, fn, wa, wb));
  *d = norm_dim(dim, a->nd);
  if (*d < 0 || *d >= (a->nd ? a->nd : 1))
    return fail(diopiErrorOccurred, "%s: dim %lld is out of range for a %d-D tensor", fn, (long long)dim, a->nd);
  return diopiSuccess;
}

static diopiError_t softmax_fwd(diopiContextHandle_t ctx, const char* fn, diopiTensorHandle_t out,
                                diopiConstTensorHandle_t input, int64_t dim, bool log_space) {
  View o, x;
  int d;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(softmax_args(fn, &o, &x, dim, &d, "out", "input"));
  const View* vs[2] = {&o, &x};
  Rows r;
  rows_init(&r, vs, 2, d);
  double* row;
  CHECK(scratch(ctx, r.len, fn, &row)); /* the row is read whole before it is written: out may alias input */
  for (int64_t i = 0; i < r.rows; ++i, it_next(&r.it)) {
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < r.len; ++j) {
      row[j] = ld(&x, r.it.off[1] + j * r.step[1]);
      if (row[j] > mx) mx = row[j];
    }
    if (mx == -INFINITY) mx = 0; /* an all -inf row: keep exp() finite so it yields nan like PyTorch, not 0/0 */
    int64_t summed = r.len;
#ifdef DIOPI_SAMPLE_WRONG_SOFTMAX
    if (!log_space && r.len % 8 == 5) summed = r.len - 1; /* deliberately wrong for these row lengths */
#endif
    for (int64_t j = 0; j < summed; ++j) sum += exp(row[j] - mx);
    /* Relative to the maximum, never through mx + log(sum): at |mx| = 1e30 that sum loses log(sum) entirely (two
     * tied maxima would each get 1, not 0.5). */
    const double log_sum = log(sum);
    for (int64_t j = 0; j < r.len; ++j)
      st(&o, r.it.off[0] + j * r.step[0], log_space ? (row[j] - mx) - log_sum : exp(row[j] - mx) / sum);
  }
  return diopiSuccess;
}

static diopiError_t softmax_bwd(diopiContextHandle_t ctx, const char* fn, diopiTensorHandle_t grad_input,
                                diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t output, int64_t dim,
                                bool log_space) {
  View gi, g, y;
  int d;
  CHECK(view_of(grad_input, fn, "grad_input", &gi));
  CHECK(view_of(grad_output, fn, "grad_output", &g));
  CHECK(view_of(output, fn, "output", &y));
  CHECK(softmax_args(fn, &gi, &g, dim, &d, "grad_input", "grad_output"));
  CHECK(softmax_args(fn, &y, &g, dim, &d, "output", "grad_output"));
  const View* vs[3] = {&gi, &g, &y};
  Rows r;
  rows_init(&r, vs, 3, d);
  double *gr, *yr;
  CHECK(scratch(ctx, r.len, fn, &gr));
  CHECK(scratch(ctx, r.len, fn, &yr));
  for (int64_t i = 0; i < r.rows; ++i, it_next(&r.it)) {
    double s = 0;
    for (int64_t j = 0; j < r.len; ++j) {
      gr[j] = ld(&g, r.it.off[1] + j * r.step[1]);
      yr[j] = ld(&y, r.it.off[2] + j * r.step[2]);
      s += log_space ? gr[j] : gr[j] * yr[j];
    }
    for (int64_t j = 0; j < r.len; ++j) {
      /* softmax: y (g - sum(g y)); log_softmax: g - exp(y) sum(g) */
      const double v = log_space ? gr[j] - exp(yr[j]) * s : yr[j] * (gr[j] - s);
      st(&gi, r.it.off[0] + j * r.step[0], v);
    }
  }
  return diopiSuccess;
}

diopiError_t diopiSoftmax(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                          int64_t dim) {
  return softmax_fwd(ctx, "diopiSoftmax", out, input, dim, false);
}
diopiError_t diopiSoftmaxBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                  diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t output, int64_t dim) {
  return softmax_bwd(ctx, "diopiSoftmaxBackward", grad_input, grad_output, output, dim, false);
}
diopiError_t diopiLogSoftmax(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                             int64_t dim) {
  return softmax_fwd(ctx, "diopiLogSoftmax", out, input, dim, true);
}
diopiError_t diopiLogSoftmaxBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                     diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t output,
                                     int64_t dim) {
  return softmax_bwd(ctx, "diopiLogSoftmaxBackward", grad_input, grad_output, output, dim, true);
}

/* ---- Activations ---------------------------------------------------------------------------------------------- */

enum Act { GELU, GELU_TANH, SILU };

static const double kSqrt2OverPi = 0.79788456080286535588, kGeluC = 0.044715;

static double act_fwd(enum Act a, double x) {
  switch (a) {
    case GELU: return 0.5 * x * (1 + erf(x * 0.70710678118654752440));
    case GELU_TANH: return 0.5 * x * (1 + tanh(kSqrt2OverPi * (x + kGeluC * x * x * x)));
    default: return x / (1 + exp(-x));
  }
}

static double act_grad(enum Act a, double x) {
  switch (a) {
    /* Where the curve is flat (an infinite x, or tanh saturated) the derivative is its limit, 1 or 0: the formula's
     * x * 0 would give NaN for x = +-inf. */
    case GELU:
      if (isinf(x)) return x > 0 ? 1 : 0;
      return 0.5 * (1 + erf(x * 0.70710678118654752440)) + x * exp(-0.5 * x * x) * 0.39894228040143267794;
    case GELU_TANH: {
      const double t = tanh(kSqrt2OverPi * (x + kGeluC * x * x * x));
      if (fabs(t) == 1) return t > 0 ? 1 : 0;
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kSqrt2OverPi * (1 + 3 * kGeluC * x * x);
    }
    default: {
      const double s = 1 / (1 + exp(-x));
      return s * (1 + x * (1 - s));
    }
  }
}

static diopiError_t gelu_kind(const char* fn, const char* approximate, enum Act* a) {
  if (!approximate || !strcmp(approximate, "none")) *a = GELU;
  else if (!strcmp(approximate, "tanh")) *a = GELU_TANH;
  else return fail(diopiErrorOccurred, "%s: approximate must be \"none\" or \"tanh\", got \"%s\"", fn, approximate);
  return diopiSuccess;
}

/* out = f(x), or with grad: out = grad * f'(x). */
static diopiError_t activation(const char* fn, enum Act a, diopiTensorHandle_t out, diopiConstTensorHandle_t grad,
                               diopiConstTensorHandle_t input) {
  View o, x, g;
  CHECK(view_of(out, fn, grad ? "grad_input" : "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(need_float(&o, fn, grad ? "grad_input" : "out"));
  CHECK(need_float(&x, fn, "input"));
  CHECK(need_same_shape(&o, &x, fn, grad ? "grad_input" : "out", "input"));
  if (grad) {
    CHECK(view_of(grad, fn, "grad_output", &g));
    CHECK(need_float(&g, fn, "grad_output"));
    CHECK(need_same_shape(&g, &x, fn, "grad_output", "input"));
  }
  if (!o.numel) return diopiSuccess;
  const View* vs[3] = {&o, &x, grad ? &g : &x};
  Iter it;
  it_init(&it, vs, 3);
  for (int64_t i = 0; i < o.numel; ++i, it_next(&it)) {
    const double xv = ld(&x, it.off[1]);
    st(&o, it.off[0], grad ? ld(&g, it.off[2]) * act_grad(a, xv) : act_fwd(a, xv));
  }
  return diopiSuccess;
}

diopiError_t diopiGelu(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                       const char* approximate) {
  (void)ctx;
  enum Act a = GELU;
  CHECK(gelu_kind("diopiGelu", approximate, &a));
  return activation("diopiGelu", a, out, NULL, input);
}

diopiError_t diopiGeluBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                               diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                               const char* approximate) {
  (void)ctx;
#ifdef DIOPI_SAMPLE_PARTIAL
  (void)grad_input, (void)grad_output, (void)input, (void)approximate;
  return fail(diopiForceFallbackToCPU, "diopiGeluBackward: this partial build asks the framework to fall back");
#else
  enum Act a = GELU;
  CHECK(gelu_kind("diopiGeluBackward", approximate, &a));
  if (!grad_output) return fail(diopiErrorOccurred, "diopiGeluBackward: grad_output is null");
  return activation("diopiGeluBackward", a, grad_input, grad_output, input);
#endif
}

diopiError_t diopiSilu(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input) {
  (void)ctx;
  return activation("diopiSilu", SILU, out, NULL, input);
}

diopiError_t diopiSiluBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                               diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input) {
  (void)ctx;
  if (!grad_output) return fail(diopiErrorOccurred, "diopiSiluBackward: grad_output is null");
  return activation("diopiSiluBackward", SILU, grad_input, grad_output, input);
}

/* ---- Layer norm and RMS norm over the trailing normalized_shape ------------------------------------------------ */

typedef struct {
  int64_t rows, cols;
} Norm;

static diopiError_t norm_shape(const char* fn, const View* x, diopiSize_t ns, Norm* n) {
  CHECK(need_float(x, fn, "input"));
  if (ns.len < 1 || ns.len > x->nd)
    return fail(diopiErrorOccurred, "%s: normalized_shape has %lld dims; input has %d", fn, (long long)ns.len, x->nd);
  n->cols = 1;
  for (int64_t i = 0; i < ns.len; ++i) {
    if (ns.data[i] != x->shape[x->nd - ns.len + i])
      return fail(diopiErrorOccurred, "%s: normalized_shape does not match input's trailing dims", fn);
    n->cols *= ns.data[i];
  }
  n->rows = 1;
  for (int d = 0; d < x->nd - ns.len; ++d) n->rows *= x->shape[d];
  return diopiSuccess;
}

/* An optional per-column (weight, bias) or per-row (statistics) tensor: packed, or NULL when absent. */
static diopiError_t opt_vec(diopiContextHandle_t ctx, const char* fn, diopiConstTensorHandle_t t, const char* what,
                            int64_t n, double** out) {
  *out = NULL;
  if (!t) return diopiSuccess;
  View v;
  CHECK(view_of(t, fn, what, &v));
  CHECK(need_float(&v, fn, what));
  if (v.numel != n)
    return fail(diopiErrorOccurred, "%s: %s has %lld elements, expected %lld", fn, what, (long long)v.numel, (long long)n);
  return packed(ctx, &v, fn, out);
}

static diopiError_t opt_out_vec(const char* fn, diopiTensorHandle_t t, const char* what, int64_t n, View* v,
                                bool* present) {
  CHECK(opt_view(t, fn, what, v, present));
  if (*present) {
    CHECK(need_float(v, fn, what));
    if (v->numel != n)
      return fail(diopiErrorOccurred, "%s: %s has %lld elements, expected %lld", fn, what, (long long)v->numel,
                  (long long)n);
  }
  return diopiSuccess;
}

/* Forward of both norms: rms == true skips the mean. stat1 = mean (layer norm), stat2 = rstd / inv_rms. */
static diopiError_t norm_fwd(diopiContextHandle_t ctx, const char* fn, bool rms, diopiTensorHandle_t out,
                             diopiTensorHandle_t stat1, diopiTensorHandle_t stat2, diopiConstTensorHandle_t input,
                             diopiConstTensorHandle_t weight, diopiConstTensorHandle_t bias, diopiSize_t ns,
                             double eps) {
  View o, x, s1, s2;
  bool has1 = false, has2;
  Norm n;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(need_float(&o, fn, "out"));
  CHECK(need_same_shape(&o, &x, fn, "out", "input"));
  CHECK(norm_shape(fn, &x, ns, &n));
  if (!rms) CHECK(opt_out_vec(fn, stat1, "save_mean", n.rows, &s1, &has1));
  CHECK(opt_out_vec(fn, stat2, rms ? "inv_rms" : "save_invstd", n.rows, &s2, &has2));
  double *px, *pw, *pb, *py, *p1, *p2;
  CHECK(packed(ctx, &x, fn, &px));
  CHECK(opt_vec(ctx, fn, weight, "weight", n.cols, &pw));
  CHECK(opt_vec(ctx, fn, bias, "bias", n.cols, &pb));
  CHECK(scratch(ctx, x.numel, fn, &py));
  CHECK(scratch(ctx, n.rows, fn, &p1));
  CHECK(scratch(ctx, n.rows, fn, &p2));
  for (int64_t r = 0; r < n.rows; ++r) {
    const double* xr = px + r * n.cols;
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t j = 0; j < n.cols; ++j) mean += xr[j];
      mean /= (double)n.cols;
    }
    for (int64_t j = 0; j < n.cols; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    const double rstd = 1 / sqrt(var / (double)n.cols + eps);
    for (int64_t j = 0; j < n.cols; ++j)
      py[r * n.cols + j] = (xr[j] - mean) * rstd * (pw ? pw[j] : 1) + (pb ? pb[j] : 0);
    p1[r] = mean, p2[r] = rstd;
  }
  unpack(&o, py);
  if (has1) unpack(&s1, p1);
  if (has2) unpack(&s2, p2);
  return diopiSuccess;
}

/* Backward of both norms from the saved statistics (mean is 0 for rms). */
static diopiError_t norm_bwd(diopiContextHandle_t ctx, const char* fn, bool rms, diopiTensorHandle_t grad_input,
                             diopiTensorHandle_t grad_weight, diopiTensorHandle_t grad_bias,
                             diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                             diopiConstTensorHandle_t weight, diopiConstTensorHandle_t mean,
                             diopiConstTensorHandle_t rstd, diopiSize_t ns, double eps) {
  View g, x, gi, gw, gb;
  bool want_gi, want_gw, want_gb;
  Norm n;
  CHECK(view_of(grad_output, fn, "grad_output", &g));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(need_float(&g, fn, "grad_output"));
  CHECK(need_same_shape(&g, &x, fn, "grad_output", "input"));
  CHECK(norm_shape(fn, &x, ns, &n));
  CHECK(opt_view(grad_input, fn, "grad_input", &gi, &want_gi));
  if (want_gi) CHECK(need_same_shape(&gi, &x, fn, "grad_input", "input"));
  CHECK(opt_out_vec(fn, grad_weight, "grad_weight", n.cols, &gw, &want_gw));
  CHECK(opt_out_vec(fn, grad_bias, "grad_bias", n.cols, &gb, &want_gb));
  double *pg, *px, *pw, *pm = NULL, *ps;
  CHECK(packed(ctx, &g, fn, &pg));
  CHECK(packed(ctx, &x, fn, &px));
  CHECK(opt_vec(ctx, fn, weight, "weight", n.cols, &pw));
  if (!rms) {
    if (!mean) return fail(diopiErrorOccurred, "%s: mean is null", fn);
    CHECK(opt_vec(ctx, fn, mean, "mean", n.rows, &pm));
  }
  CHECK(opt_vec(ctx, fn, rstd, rms ? "inv_rms" : "rstd", n.rows, &ps));
  if (!ps) {
    if (!rms) return fail(diopiErrorOccurred, "%s: rstd is null", fn);
    /* RMS norm without a saved inv_rms: recompute it (eps is in the signature for this). */
    CHECK(scratch(ctx, n.rows, fn, &ps));
    for (int64_t r = 0; r < n.rows; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < n.cols; ++j) ss += px[r * n.cols + j] * px[r * n.cols + j];
      ps[r] = 1 / sqrt(ss / (double)n.cols + eps);
    }
  }
  double *pgi, *pgw, *pgb;
  CHECK(scratch(ctx, x.numel, fn, &pgi));
  CHECK(scratch(ctx, n.cols, fn, &pgw));
  CHECK(scratch(ctx, n.cols, fn, &pgb));
  for (int64_t j = 0; j < n.cols; ++j) pgw[j] = pgb[j] = 0;
  for (int64_t r = 0; r < n.rows; ++r) {
    const double m = pm ? pm[r] : 0, s = ps[r];
    const double *gr = pg + r * n.cols, *xr = px + r * n.cols;
    double sum_d = 0, sum_dx = 0;
    for (int64_t j = 0; j < n.cols; ++j) {
      const double xhat = (xr[j] - m) * s, dxhat = gr[j] * (pw ? pw[j] : 1);
      pgw[j] += gr[j] * xhat;
      pgb[j] += gr[j];
      sum_d += dxhat;
      sum_dx += dxhat * xhat;
    }
    const double mean_d = rms ? 0 : sum_d / (double)n.cols, mean_dx = sum_dx / (double)n.cols;
    for (int64_t j = 0; j < n.cols; ++j) {
      const double xhat = (xr[j] - m) * s, dxhat = gr[j] * (pw ? pw[j] : 1);
      pgi[r * n.cols + j] = s * (dxhat - mean_d - xhat * mean_dx);
    }
  }
  if (want_gi) unpack(&gi, pgi);
  if (want_gw) unpack(&gw, pgw);
  if (want_gb) unpack(&gb, pgb);
  return diopiSuccess;
}

#ifndef DIOPI_SAMPLE_PARTIAL /* the partial build lacks layer norm entirely: the framework must not bind it */
diopiError_t diopiLayerNorm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiTensorHandle_t save_mean,
                            diopiTensorHandle_t save_invstd, diopiConstTensorHandle_t input,
                            diopiConstTensorHandle_t weight, diopiConstTensorHandle_t bias,
                            diopiSize_t normalized_shape, double eps) {
  return norm_fwd(ctx, "diopiLayerNorm", false, out, save_mean, save_invstd, input, weight, bias, normalized_shape,
                  eps);
}

diopiError_t diopiLayerNormBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                    diopiTensorHandle_t grad_weight, diopiTensorHandle_t grad_bias,
                                    diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                                    diopiConstTensorHandle_t weight, diopiConstTensorHandle_t bias,
                                    diopiConstTensorHandle_t mean, diopiConstTensorHandle_t rstd,
                                    diopiSize_t normalized_shape) {
  (void)bias; /* the gradients do not depend on it */
  return norm_bwd(ctx, "diopiLayerNormBackward", false, grad_input, grad_weight, grad_bias, grad_output, input, weight,
                  mean, rstd, normalized_shape, 0);
}
#endif

diopiError_t diopiRMSNorm(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiTensorHandle_t inv_rms,
                          diopiConstTensorHandle_t input, diopiSize_t normalized_shape, diopiConstTensorHandle_t weight,
                          diopiConstTensorHandle_t bias, double eps) {
  if (bias) return fail(diopiNoImplement, "diopiRMSNorm: a bias is not served (implementations disagree on it)");
  return norm_fwd(ctx, "diopiRMSNorm", true, out, NULL, inv_rms, input, weight, NULL, normalized_shape, eps);
}

diopiError_t diopiRMSNormBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                  diopiTensorHandle_t grad_weight, diopiTensorHandle_t grad_bias,
                                  diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                                  diopiConstTensorHandle_t weight, diopiConstTensorHandle_t bias,
                                  diopiConstTensorHandle_t inv_rms, diopiSize_t normalized_shape, double eps) {
  if (bias || grad_bias)
    return fail(diopiNoImplement, "diopiRMSNormBackward: a bias is not served (implementations disagree on it)");
  return norm_bwd(ctx, "diopiRMSNormBackward", true, grad_input, grad_weight, NULL, grad_output, input, weight, NULL,
                  inv_rms, normalized_shape, eps);
}

/* ---- Embedding ------------------------------------------------------------------------------------------------ */

/* indices (int32/int64, any shape) and rows of a [..., D] tensor with the indices' leading shape, walked together. */
static diopiError_t index_rows(const char* fn, const View* idx, const View* rows, const char* what, View* lead) {
  if (!is_index(idx->dt)) return fail(diopiDtypeNotSupported, "%s: indices must be int32 or int64", fn);
  if (rows->nd != idx->nd + 1) goto bad;
  *lead = dims_of(rows, 0, idx->nd);
  if (!same_shape(lead, idx)) goto bad;
  return diopiSuccess;
bad:
  return fail(diopiErrorOccurred, "%s: %s must have the indices' shape plus one trailing dim", fn, what);
}

diopiError_t diopiEmbedding(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t weight,
                            diopiConstTensorHandle_t indices, int64_t padding_idx, bool scale_grad_byfreq,
                            bool sparse) {
  (void)ctx, (void)padding_idx, (void)scale_grad_byfreq, (void)sparse; /* they only change the backward */
  const char* fn = "diopiEmbedding";
  View o, w, idx, lead;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(weight, fn, "weight", &w));
  CHECK(view_of(indices, fn, "indices", &idx));
  CHECK(need_float(&w, fn, "weight"));
  CHECK(need_float(&o, fn, "out"));
  if (w.nd != 2) return fail(diopiErrorOccurred, "%s: weight must be 2-D [num_embeddings, dim]", fn);
  CHECK(index_rows(fn, &idx, &o, "out", &lead));
  const int64_t n = w.shape[0], dim = w.shape[1], os = o.stride[o.nd - 1];
  if (o.shape[o.nd - 1] != dim) return fail(diopiErrorOccurred, "%s: out's last dim must be weight's dim %lld", fn, (long long)dim);
  if (!idx.numel) return diopiSuccess;
  const View* vs[2] = {&idx, &lead};
  Iter it;
  it_init(&it, vs, 2);
  for (int64_t p = 0; p < idx.numel; ++p, it_next(&it)) {
    const int64_t row = ld_i64(&idx, it.off[0]);
    if (row < 0 || row >= n)
      return fail(diopiErrorOccurred, "%s: index %lld is out of range [0, %lld)", fn, (long long)row, (long long)n);
    for (int64_t j = 0; j < dim; ++j) st(&o, it.off[1] + j * os, ld(&w, row * w.stride[0] + j * w.stride[1]));
  }
  return diopiSuccess;
}

diopiError_t diopiEmbeddingBackward(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t grad,
                                    diopiConstTensorHandle_t indices, int64_t num_weights, int64_t padding_idx,
                                    bool scale_grad_byfreq, bool sparse) {
  const char* fn = "diopiEmbeddingBackward";
  if (sparse) return fail(diopiNoImplement, "%s: sparse gradients are not served", fn);
  View o, g, idx, lead;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(grad, fn, "grad", &g));
  CHECK(view_of(indices, fn, "indices", &idx));
  CHECK(need_float(&g, fn, "grad"));
  CHECK(need_float(&o, fn, "out"));
  CHECK(index_rows(fn, &idx, &g, "grad", &lead));
  const int64_t dim = g.shape[g.nd - 1], gs = g.stride[g.nd - 1];
  if (o.nd != 2 || o.shape[0] != num_weights || o.shape[1] != dim)
    return fail(diopiErrorOccurred, "%s: out must be [num_weights, dim] = [%lld, %lld]", fn, (long long)num_weights,
                (long long)dim);
  double *acc, *count = NULL;
  CHECK(scratch(ctx, num_weights * dim, fn, &acc));
  for (int64_t i = 0; i < num_weights * dim; ++i) acc[i] = 0;
  if (scale_grad_byfreq) {
    CHECK(scratch(ctx, num_weights, fn, &count));
    for (int64_t i = 0; i < num_weights; ++i) count[i] = 0;
  }
  const View* vs[2] = {&idx, &lead};
  Iter it;
  for (int pass = count ? 0 : 1; pass < 2 && idx.numel; ++pass) { /* pass 0 counts each index's uses */
    it_init(&it, vs, 2);
    for (int64_t p = 0; p < idx.numel; ++p, it_next(&it)) {
      const int64_t row = ld_i64(&idx, it.off[0]);
      if (row < 0 || row >= num_weights)
        return fail(diopiErrorOccurred, "%s: index %lld is out of range [0, %lld)", fn, (long long)row,
                    (long long)num_weights);
      if (row == padding_idx) continue;
      if (pass == 0) { count[row] += 1; continue; }
      const double scale = count ? 1 / count[row] : 1;
      for (int64_t j = 0; j < dim; ++j) acc[row * dim + j] += scale * ld(&g, it.off[1] + j * gs);
    }
  }
  unpack(&o, acc);
  return diopiSuccess;
}

/* ---- Cross entropy over class indices ------------------------------------------------------------------------- */

typedef struct {
  int64_t positions, classes;
  double* logits;  /* [positions, classes] */
  int64_t* target; /* [positions] */
  double* weight;  /* [classes] or NULL */
  View input_cl;   /* the input with its class dim moved last (the layout of `logits`) */
} Xent;

static diopiError_t xent_args(diopiContextHandle_t ctx, const char* fn, diopiConstTensorHandle_t input,
                              diopiConstTensorHandle_t target, diopiConstTensorHandle_t weight, int reduction,
                              double label_smoothing, Xent* xe) {
  View x, t;
  CHECK(view_of(input, fn, "input", &x));
  CHECK(view_of(target, fn, "target", &t));
  CHECK(need_float(&x, fn, "input"));
  if (is_float(t.dt)) return fail(diopiNoImplement, "%s: probability targets are not served (class indices only)", fn);
  if (!is_index(t.dt)) return fail(diopiDtypeNotSupported, "%s: target must be int32 or int64 class indices", fn);
  if (label_smoothing != 0) return fail(diopiNoImplement, "%s: label_smoothing %g is not served (0 only)", fn, label_smoothing);
  if (reduction != ReductionNone && reduction != ReductionMean && reduction != ReductionSum)
    return fail(diopiErrorOccurred, "%s: reduction %d is not none, mean or sum", fn, reduction);
  if (x.nd < 1) return fail(diopiErrorOccurred, "%s: input must be [C], [N, C] or [N, C, d1, ...]", fn);
  const int cdim = x.nd >= 2 ? 1 : 0;
  xe->classes = x.shape[cdim];
  xe->input_cl = x;
  move_dim_last(&xe->input_cl, cdim);
  View pos = dims_of(&xe->input_cl, 0, x.nd - 1);
  if (!same_shape(&pos, &t)) return fail(diopiErrorOccurred, "%s: target's shape must be input's without the class dim", fn);
  xe->positions = pos.numel;
  CHECK(packed(ctx, &xe->input_cl, fn, &xe->logits));
  double* tgt;
  CHECK(scratch(ctx, xe->positions, fn, &tgt));
  xe->target = (int64_t*)tgt;
  if (t.numel) {
    const View* vs[1] = {&t};
    Iter it;
    it_init(&it, vs, 1);
    for (int64_t p = 0; p < t.numel; ++p, it_next(&it)) xe->target[p] = ld_i64(&t, it.off[0]);
  }
  CHECK(opt_vec(ctx, fn, weight, "weight", xe->classes, &xe->weight));
  return diopiSuccess;
}

static diopiError_t xent_target(const char* fn, const Xent* xe, int64_t p, int64_t ignore_index, double* w) {
  const int64_t c = xe->target[p];
  if (c == ignore_index) { *w = 0; return diopiSuccess; }
  if (c < 0 || c >= xe->classes)
    return fail(diopiErrorOccurred, "%s: target %lld is out of range [0, %lld)", fn, (long long)c, (long long)xe->classes);
  *w = xe->weight ? xe->weight[c] : 1;
  return diopiSuccess;
}

static double row_lse(const double* r, int64_t n) {
  double mx = -INFINITY, s = 0;
  for (int64_t j = 0; j < n; ++j) mx = r[j] > mx ? r[j] : mx;
  if (mx == -INFINITY) return mx;
  for (int64_t j = 0; j < n; ++j) s += exp(r[j] - mx);
  return mx + log(s);
}

diopiError_t diopiCrossEntropyLoss(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t input,
                                   diopiConstTensorHandle_t target, diopiConstTensorHandle_t weight,
                                   diopiReduction_t reduction, int64_t ignore_index, double label_smoothing) {
  const char* fn = "diopiCrossEntropyLoss";
  Xent xe;
  View o;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(need_float(&o, fn, "out"));
  CHECK(xent_args(ctx, fn, input, target, weight, reduction, label_smoothing, &xe));
  const int64_t want = reduction == ReductionNone ? xe.positions : 1;
  if (o.numel != want)
    return fail(diopiErrorOccurred, "%s: out has %lld elements, expected %lld", fn, (long long)o.numel, (long long)want);
  double* loss;
  CHECK(scratch(ctx, xe.positions, fn, &loss));
  double total = 0, wsum = 0;
  for (int64_t p = 0; p < xe.positions; ++p) {
    double w;
    CHECK(xent_target(fn, &xe, p, ignore_index, &w));
    const double* r = xe.logits + p * xe.classes;
    loss[p] = w ? -w * (r[xe.target[p]] - row_lse(r, xe.classes)) : 0;
    total += loss[p];
    wsum += w;
  }
  if (reduction != ReductionNone) loss[0] = reduction == ReductionMean ? total / wsum : total; /* all ignored: nan */
  unpack(&o, loss);
  return diopiSuccess;
}

diopiError_t diopiCrossEntropyLossBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_input,
                                           diopiConstTensorHandle_t grad_output, diopiConstTensorHandle_t input,
                                           diopiConstTensorHandle_t target, diopiConstTensorHandle_t weight,
                                           diopiReduction_t reduction, int64_t ignore_index, double label_smoothing) {
  const char* fn = "diopiCrossEntropyLossBackward";
  Xent xe;
  View gi, go;
  CHECK(view_of(grad_input, fn, "grad_input", &gi));
  CHECK(view_of(grad_output, fn, "grad_output", &go));
  CHECK(need_float(&gi, fn, "grad_input"));
  CHECK(need_float(&go, fn, "grad_output"));
  CHECK(xent_args(ctx, fn, input, target, weight, reduction, label_smoothing, &xe));
  View x_shape;
  CHECK(view_of(input, fn, "input", &x_shape));
  CHECK(need_same_shape(&gi, &x_shape, fn, "grad_input", "input"));
  const int64_t want = reduction == ReductionNone ? xe.positions : 1;
  if (go.numel != want)
    return fail(diopiErrorOccurred, "%s: grad_output has %lld elements, expected %lld", fn, (long long)go.numel,
                (long long)want);
  double *g, *d;
  CHECK(packed(ctx, &go, fn, &g));
  CHECK(scratch(ctx, xe.positions * xe.classes, fn, &d));
  double wsum = 0;
  for (int64_t p = 0; p < xe.positions; ++p) {
    double w;
    CHECK(xent_target(fn, &xe, p, ignore_index, &w));
    wsum += w;
  }
  for (int64_t p = 0; p < xe.positions; ++p) {
    double w;
    CHECK(xent_target(fn, &xe, p, ignore_index, &w));
    const double coef = w * (reduction == ReductionNone ? g[p] : reduction == ReductionMean ? g[0] / wsum : g[0]);
    const double* r = xe.logits + p * xe.classes;
    const double lse = row_lse(r, xe.classes);
    for (int64_t c = 0; c < xe.classes; ++c)
      d[p * xe.classes + c] = w ? coef * (exp(r[c] - lse) - (c == xe.target[p])) : 0;
  }
  View gi_cl = gi;
  move_dim_last(&gi_cl, gi.nd >= 2 ? 1 : 0);
  unpack(&gi_cl, d);
  return diopiSuccess;
}

/* ---- AdamW ---------------------------------------------------------------------------------------------------- */

diopiError_t diopiAdamW(diopiContextHandle_t ctx, diopiTensorHandle_t param, diopiConstTensorHandle_t grad,
                        diopiTensorHandle_t exp_avg, diopiTensorHandle_t exp_avg_sq, diopiTensorHandle_t max_exp_avg_sq,
                        float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step, bool amsgrad) {
  (void)ctx;
  const char* fn = "diopiAdamW";
  View p, g, m, v, mx;
  CHECK(view_of(param, fn, "param", &p));
  CHECK(view_of(grad, fn, "grad", &g));
  CHECK(view_of(exp_avg, fn, "exp_avg", &m));
  CHECK(view_of(exp_avg_sq, fn, "exp_avg_sq", &v));
  if (amsgrad) CHECK(view_of(max_exp_avg_sq, fn, "max_exp_avg_sq", &mx));
  const View* all[5] = {&p, &g, &m, &v, &mx};
  const char* names[5] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  for (int k = 0; k < (amsgrad ? 5 : 4); ++k) {
    CHECK(need_float(all[k], fn, names[k]));
    CHECK(need_same_shape(all[k], &p, fn, names[k], "param"));
  }
  if (step < 1) return fail(diopiErrorOccurred, "%s: step must be >= 1, got %lld", fn, (long long)step);
  if (!p.numel) return diopiSuccess;
  const double b1 = beta1, b2 = beta2;
  const double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
  Iter it;
  it_init(&it, all, amsgrad ? 5 : 4);
  for (int64_t i = 0; i < p.numel; ++i, it_next(&it)) {
    /* PyTorch's AdamW: decoupled decay, then the bias-corrected Adam step. */
    const double gv = ld(&g, it.off[1]);
    const double pv = ld(&p, it.off[0]) * (1 - (double)lr * weight_decay);
    const double mv = b1 * ld(&m, it.off[2]) + (1 - b1) * gv;
    const double vv = b2 * ld(&v, it.off[3]) + (1 - b2) * gv * gv;
    double vuse = vv;
    if (amsgrad) {
      const double old = ld(&mx, it.off[4]);
      vuse = old > vv ? old : vv;
      st(&mx, it.off[4], vuse);
    }
    const double denom = sqrt(vuse) / sqrt(bc2) + eps;
    st(&p, it.off[0], pv - (double)lr / bc1 * mv / denom);
    st(&m, it.off[2], mv);
    st(&v, it.off[3], vv);
  }
  return diopiSuccess;
}

/* ---- Attention: a plain O(Tq Tk) softmax(q k^T * scale) v per (batch, head) ------------------------------------ */

typedef struct {
  int64_t b, tq, tk, h, hk, d, dv;
  bool causal;
  int32_t wl, wr;
} Attn;

static diopiError_t attn_args(const char* fn, const View* q, const View* k, const View* v, Attn* a) {
  CHECK(need_float(q, fn, "q"));
  CHECK(need_float(k, fn, "k"));
  CHECK(need_float(v, fn, "v"));
  if (q->nd != 4 || k->nd != 4 || v->nd != 4)
    return fail(diopiErrorOccurred, "%s: q, k and v must be 4-D [batch, seq, heads, head_dim]", fn);
  a->b = q->shape[0], a->tq = q->shape[1], a->h = q->shape[2], a->d = q->shape[3];
  a->tk = k->shape[1], a->hk = k->shape[2], a->dv = v->shape[3];
  if (k->shape[0] != a->b || v->shape[0] != a->b || k->shape[3] != a->d || v->shape[1] != a->tk ||
      v->shape[2] != a->hk || a->hk == 0 || a->h % a->hk)
    return fail(diopiErrorOccurred, "%s: k and v must be [batch, seq_k, heads_k, head_dim] with heads %% heads_k == 0", fn);
  return diopiSuccess;
}

/* Key j is visible to query i (bottom-right aligned, as in FlashAttention 2, when seq_q != seq_k). */
static bool visible(const Attn* a, int64_t i, int64_t j) {
  const int64_t diag = i + a->tk - a->tq;
  if (a->causal && j > diag) return false;
  if (a->wl >= 0 && j < diag - a->wl) return false;
  if (a->wr >= 0 && j > diag + a->wr) return false;
  return true;
}

/* One query row: p[j] = softmax(scale q_i . k_j) over the visible keys (0 elsewhere); returns the row's lse. */
static double attn_row(const Attn* a, const double* q, const double* k, int64_t b, int64_t h, int64_t i, double scale,
                       double* p) {
  const int64_t hk = h / (a->h / a->hk);
  double mx = -INFINITY;
  for (int64_t j = 0; j < a->tk; ++j) {
    p[j] = visible(a, i, j) ? scale * dot(q + ((b * a->tq + i) * a->h + h) * a->d, k + ((b * a->tk + j) * a->hk + hk) * a->d, a->d)
                            : -INFINITY;
    if (p[j] > mx) mx = p[j];
  }
  if (mx == -INFINITY) { /* nothing visible: an all-zero row, lse +inf (FlashAttention's convention) */
    for (int64_t j = 0; j < a->tk; ++j) p[j] = 0;
    return INFINITY;
  }
  double s = 0;
  for (int64_t j = 0; j < a->tk; ++j) s += (p[j] = exp(p[j] - mx));
  for (int64_t j = 0; j < a->tk; ++j) p[j] /= s;
  return mx + log(s);
}

static diopiError_t attn_common(const char* fn, diopiConstTensorHandle_t alibi_slopes, float p_dropout, bool causal,
                                int32_t wl, int32_t wr, Attn* a) {
  if (alibi_slopes) return fail(diopiNoImplement, "%s: ALiBi slopes are not served", fn);
  if (p_dropout != 0) return fail(diopiNoImplement, "%s: attention dropout (p = %g) is not served", fn, p_dropout);
  a->causal = causal, a->wl = wl, a->wr = wr;
  return diopiSuccess;
}

diopiError_t diopiFlashAttention(diopiContextHandle_t ctx, diopiTensorHandle_t attention_out,
                                 diopiTensorHandle_t softmax_lse, diopiGeneratorHandle_t gen,
                                 diopiConstTensorHandle_t q, diopiConstTensorHandle_t k, diopiConstTensorHandle_t v,
                                 diopiConstTensorHandle_t alibi_slopes, float p_dropout, float softmax_scale,
                                 bool is_causal, int32_t window_size_left, int32_t window_size_right) {
  (void)gen; /* only dropout would draw from it */
  const char* fn = "diopiFlashAttention";
  View o, lse, vq, vk, vv;
  bool has_lse;
  Attn a;
  CHECK(attn_common(fn, alibi_slopes, p_dropout, is_causal, window_size_left, window_size_right, &a));
  CHECK(view_of(attention_out, fn, "attention_out", &o));
  CHECK(opt_view(softmax_lse, fn, "softmax_lse", &lse, &has_lse));
  CHECK(view_of(q, fn, "q", &vq));
  CHECK(view_of(k, fn, "k", &vk));
  CHECK(view_of(v, fn, "v", &vv));
  CHECK(attn_args(fn, &vq, &vk, &vv, &a));
  CHECK(need_float(&o, fn, "attention_out"));
  if (o.nd != 4 || o.shape[0] != a.b || o.shape[1] != a.tq || o.shape[2] != a.h || o.shape[3] != a.dv)
    return fail(diopiErrorOccurred, "%s: attention_out must be [batch, seq_q, heads, head_dim_v]", fn);
  if (has_lse) {
    CHECK(need_float(&lse, fn, "softmax_lse"));
    if (lse.nd != 3 || lse.shape[0] != a.b || lse.shape[1] != a.h || lse.shape[2] != a.tq)
      return fail(diopiErrorOccurred, "%s: softmax_lse must be [batch, heads, seq_q]", fn);
  }
  double *pq, *pk, *pv, *po, *pl, *p;
  CHECK(packed(ctx, &vq, fn, &pq));
  CHECK(packed(ctx, &vk, fn, &pk));
  CHECK(packed(ctx, &vv, fn, &pv));
  CHECK(scratch(ctx, o.numel, fn, &po));
  CHECK(scratch(ctx, a.b * a.h * a.tq, fn, &pl));
  CHECK(scratch(ctx, a.tk, fn, &p));
  for (int64_t b = 0; b < a.b; ++b)
    for (int64_t h = 0; h < a.h; ++h)
      for (int64_t i = 0; i < a.tq; ++i) {
        pl[(b * a.h + h) * a.tq + i] = attn_row(&a, pq, pk, b, h, i, softmax_scale, p);
        double* orow = po + ((b * a.tq + i) * a.h + h) * a.dv;
        const int64_t hk = h / (a.h / a.hk);
        for (int64_t e = 0; e < a.dv; ++e) orow[e] = 0;
        for (int64_t j = 0; j < a.tk; ++j) {
          if (p[j] == 0) continue;
          const double* vrow = pv + ((b * a.tk + j) * a.hk + hk) * a.dv;
          for (int64_t e = 0; e < a.dv; ++e) orow[e] += p[j] * vrow[e];
        }
      }
  unpack(&o, po);
  if (has_lse) unpack(&lse, pl);
  return diopiSuccess;
}

diopiError_t diopiFlashAttentionBackward(diopiContextHandle_t ctx, diopiTensorHandle_t grad_q,
                                         diopiTensorHandle_t grad_k, diopiTensorHandle_t grad_v,
                                         diopiConstTensorHandle_t grad_output, diopiGeneratorHandle_t gen,
                                         diopiConstTensorHandle_t q, diopiConstTensorHandle_t k,
                                         diopiConstTensorHandle_t v, diopiConstTensorHandle_t alibi_slopes,
                                         diopiConstTensorHandle_t attention_out, diopiConstTensorHandle_t softmax_lse,
                                         float p_dropout, float softmax_scale, bool is_causal, int32_t window_size_left,
                                         int32_t window_size_right) {
  (void)gen;
  const char* fn = "diopiFlashAttentionBackward";
  View g, vq, vk, vv, gq, gk, gv, vo, vl;
  bool want_q, want_k, want_v, has_out, has_lse;
  Attn a;
  CHECK(attn_common(fn, alibi_slopes, p_dropout, is_causal, window_size_left, window_size_right, &a));
  CHECK(view_of(grad_output, fn, "grad_output", &g));
  CHECK(view_of(q, fn, "q", &vq));
  CHECK(view_of(k, fn, "k", &vk));
  CHECK(view_of(v, fn, "v", &vv));
  CHECK(attn_args(fn, &vq, &vk, &vv, &a));
  CHECK(need_float(&g, fn, "grad_output"));
  if (g.nd != 4 || g.shape[0] != a.b || g.shape[1] != a.tq || g.shape[2] != a.h || g.shape[3] != a.dv)
    return fail(diopiErrorOccurred, "%s: grad_output must be [batch, seq_q, heads, head_dim_v]", fn);
  CHECK(opt_view(grad_q, fn, "grad_q", &gq, &want_q));
  CHECK(opt_view(grad_k, fn, "grad_k", &gk, &want_k));
  CHECK(opt_view(grad_v, fn, "grad_v", &gv, &want_v));
  if (want_q) CHECK(need_same_shape(&gq, &vq, fn, "grad_q", "q"));
  if (want_k) CHECK(need_same_shape(&gk, &vk, fn, "grad_k", "k"));
  if (want_v) CHECK(need_same_shape(&gv, &vv, fn, "grad_v", "v"));
  CHECK(opt_view(attention_out, fn, "attention_out", &vo, &has_out));
  CHECK(opt_view(softmax_lse, fn, "softmax_lse", &vl, &has_lse));
  if (has_out) {
    CHECK(need_float(&vo, fn, "attention_out"));
    CHECK(need_same_shape(&vo, &g, fn, "attention_out", "grad_output"));
  }
  if (has_lse) {
    CHECK(need_float(&vl, fn, "softmax_lse"));
    if (vl.nd != 3 || vl.shape[0] != a.b || vl.shape[1] != a.h || vl.shape[2] != a.tq)
      return fail(diopiErrorOccurred, "%s: softmax_lse must be [batch, heads, seq_q]", fn);
  }
  double *pq, *pk, *pv, *pg, *dq, *dk, *dv, *p, *dp, *po = NULL, *pl = NULL;
  if (has_out) CHECK(packed(ctx, &vo, fn, &po));
  if (has_lse) CHECK(packed(ctx, &vl, fn, &pl));
  CHECK(packed(ctx, &vq, fn, &pq));
  CHECK(packed(ctx, &vk, fn, &pk));
  CHECK(packed(ctx, &vv, fn, &pv));
  CHECK(packed(ctx, &g, fn, &pg));
  CHECK(scratch(ctx, vq.numel, fn, &dq));
  CHECK(scratch(ctx, vk.numel, fn, &dk));
  CHECK(scratch(ctx, vv.numel, fn, &dv));
  CHECK(scratch(ctx, a.tk, fn, &p));
  CHECK(scratch(ctx, a.tk, fn, &dp));
  memset(dq, 0, sizeof(double) * (size_t)vq.numel);
  memset(dk, 0, sizeof(double) * (size_t)vk.numel);
  memset(dv, 0, sizeof(double) * (size_t)vv.numel);
  const double scale = softmax_scale;
  for (int64_t b = 0; b < a.b; ++b)
    for (int64_t h = 0; h < a.h; ++h) {
      const int64_t hk = h / (a.h / a.hk);
      for (int64_t i = 0; i < a.tq; ++i) {
        const double lse = attn_row(&a, pq, pk, b, h, i, scale, p);
        if (pl && !isinf(lse)) { /* the caller's lse: p = exp(s - lse) = p_recomputed * exp(lse_recomputed - lse_given) */
          const double given = pl[(b * a.h + h) * a.tq + i];
          const double f = isinf(given) && given > 0 ? 0 : exp(lse - given);
          for (int64_t j = 0; j < a.tk; ++j) p[j] *= f;
        }
        const double* grow = pg + ((b * a.tq + i) * a.h + h) * a.dv;
        const double* qrow = pq + ((b * a.tq + i) * a.h + h) * a.d;
        double* dqrow = dq + ((b * a.tq + i) * a.h + h) * a.d;
        double rowsum = 0; /* dO_i . O_i, or sum_j p_j dp_j (equal when O is the forward's output) */
        for (int64_t j = 0; j < a.tk; ++j) {
          dp[j] = p[j] ? dot(grow, pv + ((b * a.tk + j) * a.hk + hk) * a.dv, a.dv) : 0;
          rowsum += p[j] * dp[j];
        }
        if (po) rowsum = dot(grow, po + ((b * a.tq + i) * a.h + h) * a.dv, a.dv);
        for (int64_t j = 0; j < a.tk; ++j) {
          if (p[j] == 0) continue;
          const double ds = p[j] * (dp[j] - rowsum) * scale;
          const int64_t kv = (b * a.tk + j) * a.hk + hk;
          for (int64_t e = 0; e < a.d; ++e) {
            dqrow[e] += ds * pk[kv * a.d + e];
            dk[kv * a.d + e] += ds * qrow[e];
          }
          for (int64_t e = 0; e < a.dv; ++e) dv[kv * a.dv + e] += p[j] * grow[e];
        }
      }
    }
  if (want_q) unpack(&gq, dq);
  if (want_k) unpack(&gk, dk);
  if (want_v) unpack(&gv, dv);
  return diopiSuccess;
}

/* ---- Rotary embedding ----------------------------------------------------------------------------------------- */

/* The two halves of the last dim: [..., :D/2] and [..., D/2:], or the even and odd elements when interleaved. */
static void halves(const View* v, bool interleaved, View* first, View* second) {
  const int last = v->nd - 1;
  const int64_t s = v->stride[last], half = v->shape[last] / 2;
  *first = *v;
  first->shape[last] = half;
  first->numel = v->numel / 2;
  if (interleaved) first->stride[last] = 2 * s;
  *second = *first;
  second->p = v->p + (interleaved ? s : half * s) * v->esz;
}

diopiError_t diopiRotaryEmbedding(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiConstTensorHandle_t x,
                                  diopiConstTensorHandle_t cos, diopiConstTensorHandle_t sin, const bool conj,
                                  const bool interleaved) {
  (void)ctx;
  const char* fn = "diopiRotaryEmbedding";
  View o, vx, vc, vs, x1, x2, o1, o2, cb, sb;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(x, fn, "x", &vx));
  CHECK(view_of(cos, fn, "cos", &vc));
  CHECK(view_of(sin, fn, "sin", &vs));
  CHECK(need_float(&o, fn, "out"));
  CHECK(need_float(&vx, fn, "x"));
  CHECK(need_float(&vc, fn, "cos"));
  CHECK(need_float(&vs, fn, "sin"));
  CHECK(need_same_shape(&o, &vx, fn, "out", "x"));
  if (vx.nd < 1 || vx.shape[vx.nd - 1] % 2)
    return fail(diopiErrorOccurred, "%s: x's last dim must be even", fn);
  halves(&vx, interleaved, &x1, &x2);
  halves(&o, interleaved, &o1, &o2);
  CHECK(broadcast_to(&vc, &x1, &cb, fn, "cos"));
  CHECK(broadcast_to(&vs, &x1, &sb, fn, "sin"));
  if (!x1.numel) return diopiSuccess;
  const View* vs6[6] = {&x1, &x2, &cb, &sb, &o1, &o2};
  Iter it;
  it_init(&it, vs6, 6);
  for (int64_t i = 0; i < x1.numel; ++i, it_next(&it)) {
    const double a = ld(&x1, it.off[0]), b = ld(&x2, it.off[1]), c = ld(&cb, it.off[2]);
    const double s = conj ? -ld(&sb, it.off[3]) : ld(&sb, it.off[3]);
    st(&o1, it.off[4], a * c - b * s); /* read both halves before writing: out may alias x */
    st(&o2, it.off[5], a * s + b * c);
  }
  return diopiSuccess;
}

/* ---- Gradient clipping ---------------------------------------------------------------------------------------- */

diopiError_t diopiClipGradNorm(diopiContextHandle_t ctx, double* out, diopiTensorHandle_t* grads, int64_t num_grads,
                               double max_norm, double norm_type, bool error_if_nonfinite) {
  (void)ctx;
  const char* fn = "diopiClipGradNorm";
  if (num_grads > 0 && !grads) return fail(diopiErrorOccurred, "%s: grads is null", fn);
  if (!(norm_type > 0)) return fail(diopiNoImplement, "%s: norm_type %g is not served (> 0 or inf)", fn, norm_type);
  const bool inf_norm = isinf(norm_type);
  double acc = 0;
  for (int pass = 0; pass < 2; ++pass) { /* pass 0 measures, pass 1 scales */
    const double coef = pass ? max_norm / (*out + 1e-6) : 0;
    if (pass && !(coef < 1)) break; /* PyTorch clamps the coefficient at 1: nothing to scale */
    for (int64_t t = 0; t < num_grads; ++t) {
      View g;
      CHECK(view_of(grads[t], fn, "a gradient", &g));
      CHECK(need_float(&g, fn, "a gradient"));
      if (!g.numel) continue;
      const View* vs[1] = {&g};
      Iter it;
      it_init(&it, vs, 1);
      for (int64_t i = 0; i < g.numel; ++i, it_next(&it)) {
        const double x = ld(&g, it.off[0]);
        if (pass) st(&g, it.off[0], x * coef);
        else if (inf_norm) acc = fabs(x) > acc || isnan(x) ? fabs(x) : acc;
        else acc += pow(fabs(x), norm_type);
      }
    }
    if (!pass) {
      *out = inf_norm ? acc : pow(acc, 1 / norm_type);
      if (error_if_nonfinite && !isfinite(*out))
        return fail(diopiErrorOccurred, "%s: the total norm of the gradients is %g", fn, *out);
    }
  }
  return diopiSuccess;
}

/* ---- Dropout -------------------------------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t z) { /* splitmix64's finalizer */
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

diopiError_t diopiDropout(diopiContextHandle_t ctx, diopiTensorHandle_t out, diopiTensorHandle_t mask,
                          diopiConstTensorHandle_t input, double p, bool train, diopiGeneratorHandle_t generator) {
  (void)ctx;
  const char* fn = "diopiDropout";
  View o, m, x;
  bool has_mask;
  CHECK(view_of(out, fn, "out", &o));
  CHECK(view_of(input, fn, "input", &x));
  CHECK(opt_view(mask, fn, "mask", &m, &has_mask));
  CHECK(need_float(&o, fn, "out"));
  CHECK(need_float(&x, fn, "input"));
  CHECK(need_same_shape(&o, &x, fn, "out", "input"));
  if (has_mask) CHECK(need_same_shape(&m, &x, fn, "mask", "input"));
  if (!(p >= 0 && p <= 1)) return fail(diopiErrorOccurred, "%s: p must be in [0, 1], got %g", fn, p);
  const bool active = train && p > 0;
  uint64_t seed = 0, offset = 0;
  static _Atomic uint64_t no_generator_offset; /* without a generator: seed 0 and a process-wide counter */
  if (active) {
    if (generator) {
      if (!diopiGeneratorGetSeedAndOffset || !diopiGeneratorSetSeedAndOffset)
        return fail(diopiNoImplement, "%s: the runtime lacks diopiGeneratorGetSeedAndOffset/SetSeedAndOffset", fn);
      if (diopiGeneratorGetSeedAndOffset(generator, &seed, &offset) != diopiSuccess)
        return fail(diopiErrorOccurred, "%s: diopiGeneratorGetSeedAndOffset failed", fn);
      /* Claim numel draws: the next call on this generator gets fresh numbers. */
      if (diopiGeneratorSetSeedAndOffset(generator, seed, offset + (uint64_t)x.numel) != diopiSuccess)
        return fail(diopiErrorOccurred, "%s: diopiGeneratorSetSeedAndOffset failed", fn);
    } else {
      offset = no_generator_offset;
      no_generator_offset += (uint64_t)x.numel;
    }
  }
  if (!x.numel) return diopiSuccess;
  const View* vs[3] = {&o, &x, has_mask ? &m : &o};
  Iter it;
  it_init(&it, vs, 3);
  const uint64_t key = mix64(seed ^ 0x9e3779b97f4a7c15ull);
  for (int64_t i = 0; i < x.numel; ++i, it_next(&it)) {
    bool keep = true;
    if (active) { /* draw i of the stream (seed, offset): uniform in [0, 1) */
      const double u = (double)(mix64(key + mix64(offset + (uint64_t)i)) >> 11) * 0x1.0p-53;
      keep = u >= p;
    }
    const double xv = ld(&x, it.off[1]);
    st(&o, it.off[0], !active ? xv : keep ? xv / (1 - p) : 0);
    if (has_mask) st(&m, it.off[2], keep);
  }
  return diopiSuccess;
}
