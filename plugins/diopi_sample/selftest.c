/* diopi_sample's own test, independent of Loom: it provides a minimal diopirt (malloc'd host tensors with any
 * strides, scratch buffers, a generator), dlopens the built libraries and checks each DIOPI function against a
 * straightforward float64 reference on fresh random inputs of awkward sizes, in several memory layouts (contiguous,
 * padded rows, every other element, column-major, each at an offset into its storage); output storage outside the
 * view must stay untouched. Backwards are also checked against central finite differences of their forwards.
 * The wrong variant must be caught on some shape and pass on others; the partial variant must lack its symbols and
 * answer diopiDtypeNotSupported / diopiForceFallbackToCPU where documented.
 *
 * usage: diopi_sample_selftest LIB WRONG_LIB PARTIAL_LIB   (DIOPI_SELFTEST_SEED=N to repeat a run)
 */
#include <dlfcn.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <diopi/diopirt.h>
#include <diopi/functions.h>
#include <diopi/functions_ext.h>

/* ---- A minimal diopirt ---------------------------------------------------------------------------------------- */

enum { MAXD = 8 };

struct diopiTensor {
  unsigned char* storage;
  size_t storage_bytes;
  int64_t offset; /* elements from storage to the view's first element */
  diopiDtype_t dt;
  int nd;
  int64_t shape[MAXD], stride[MAXD];
  diopiDevice_t device;
};

struct diopiContext {
  struct diopiTensor* scratch[4096];
  int n;
  int64_t scratch_bytes;
};

struct diopiGenerator {
  uint64_t seed, offset;
};

static int64_t esize(diopiDtype_t dt) {
  switch (dt) {
    case diopi_dtype_int8: case diopi_dtype_uint8: case diopi_dtype_bool: return 1;
    case diopi_dtype_int16: case diopi_dtype_uint16: case diopi_dtype_float16: case diopi_dtype_bfloat16: return 2;
    case diopi_dtype_int32: case diopi_dtype_uint32: case diopi_dtype_float32: return 4;
    default: return 8;
  }
}

static int64_t numel(const struct diopiTensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->nd; ++d) n *= t->shape[d];
  return n;
}

diopiError_t diopiGetTensorData(diopiTensorHandle_t th, void** p) {
  *p = th->storage + th->offset * esize(th->dt);
  return diopiSuccess;
}
diopiError_t diopiGetTensorDataConst(diopiConstTensorHandle_t th, const void** p) {
  *p = th->storage + th->offset * esize(th->dt);
  return diopiSuccess;
}
diopiError_t diopiGetTensorShape(diopiConstTensorHandle_t th, diopiSize_t* size) {
  size->data = th->shape, size->len = th->nd;
  return diopiSuccess;
}
diopiError_t diopiGetTensorStride(diopiConstTensorHandle_t th, diopiSize_t* stride) {
  stride->data = th->stride, stride->len = th->nd;
  return diopiSuccess;
}
diopiError_t diopiGetTensorDtype(diopiConstTensorHandle_t th, diopiDtype_t* dtype) {
  *dtype = th->dt;
  return diopiSuccess;
}
diopiError_t diopiGetTensorDevice(diopiConstTensorHandle_t th, diopiDevice_t* device) {
  *device = th->device;
  return diopiSuccess;
}
diopiError_t diopiGetTensorNumel(diopiConstTensorHandle_t th, int64_t* n) {
  *n = numel(th);
  return diopiSuccess;
}
diopiError_t diopiGetTensorElemSize(diopiConstTensorHandle_t th, int64_t* itemsize) {
  *itemsize = esize(th->dt);
  return diopiSuccess;
}
diopiError_t diopiGetStream(diopiContextHandle_t ctx, diopiStreamHandle_t* stream) {
  (void)ctx;
  *stream = NULL;
  return diopiSuccess;
}

static struct diopiTensor* alloc_tensor(diopiDtype_t dt, int nd, const int64_t* shape, const int64_t* stride) {
  struct diopiTensor* t = calloc(1, sizeof *t);
  t->dt = dt, t->nd = nd;
  int64_t span = 1;
  for (int d = nd - 1; d >= 0; --d) {
    t->shape[d] = shape[d];
    t->stride[d] = stride ? stride[d] : (d == nd - 1 ? 1 : t->stride[d + 1] * t->shape[d + 1]);
    if (shape[d]) span += (shape[d] - 1) * t->stride[d];
  }
  t->storage_bytes = (size_t)(span * esize(dt));
  t->storage = malloc(t->storage_bytes ? t->storage_bytes : 1);
  return t;
}

diopiError_t diopiRequireTensor(diopiContextHandle_t ctx, diopiTensorHandle_t* tensor, const diopiSize_t* size,
                                const diopiSize_t* stride, const diopiDtype_t dtype, const diopiDevice_t device) {
  if (ctx->n == 4096) return diopiErrorOccurred;
  struct diopiTensor* t = alloc_tensor(dtype, (int)size->len, size->data, stride && stride->len ? stride->data : NULL);
  t->device = device;
  memset(t->storage, 0xA5, t->storage_bytes); /* garbage: a kernel must not assume zeroed scratch */
  ctx->scratch[ctx->n++] = t;
  ctx->scratch_bytes += (int64_t)t->storage_bytes;
  *tensor = t;
  return diopiSuccess;
}

diopiError_t diopiRequireBuffer(diopiContextHandle_t ctx, diopiTensorHandle_t* tensor, int64_t num_bytes,
                                diopiDevice_t device) {
  int64_t n = num_bytes;
  diopiSize_t size = {&n, 1};
  return diopiRequireTensor(ctx, tensor, &size, NULL, diopi_dtype_uint8, device);
}

diopiError_t diopiGeneratorGetSeedAndOffset(diopiGeneratorHandle_t th, uint64_t* seed, uint64_t* offset) {
  *seed = th->seed, *offset = th->offset;
  return diopiSuccess;
}
diopiError_t diopiGeneratorSetSeedAndOffset(diopiGeneratorHandle_t th, uint64_t seed, uint64_t offset) {
  th->seed = seed, th->offset = offset;
  return diopiSuccess;
}

static struct diopiContext g_ctx;
static void ctx_reset(void) {
  for (int i = 0; i < g_ctx.n; ++i) free(g_ctx.scratch[i]->storage), free(g_ctx.scratch[i]);
  g_ctx.n = 0;
}

/* ---- Test tensors --------------------------------------------------------------------------------------------- */

typedef struct diopiTensor T;
enum Layout { CONTIG, PADDED, STEP2, COLMAJOR, NLAYOUTS };
static const char* layout_name[] = {"contiguous", "padded", "step2", "column-major"};

static T* all_tensors[1 << 16];
static int n_tensors;

/* A tensor in `layout`, starting 3 elements into its storage; every storage byte outside the view is 0xFF (a nan
 * for the float dtypes), so a kernel that reads outside the view gets nan and one that writes there is caught. */
static T* mk(diopiDtype_t dt, int nd, const int64_t* shape, enum Layout layout) {
  int64_t stride[MAXD], s = layout == STEP2 ? 2 : 1;
  if (layout == COLMAJOR) {
    for (int d = 0; d < nd; ++d) stride[d] = s, s *= shape[d] ? shape[d] : 1;
  } else {
    for (int d = nd - 1; d >= 0; --d) {
      stride[d] = s;
      s *= (shape[d] ? shape[d] : 1) + (layout == PADDED ? 3 : 0);
    }
  }
  T* t = alloc_tensor(dt, nd, shape, stride);
  free(t->storage); /* re-allocated with 3 leading and 2 trailing guard elements */
  t->offset = 3;
  size_t view_bytes = t->storage_bytes;
  t->storage_bytes = view_bytes + (size_t)(5 * esize(dt));
  t->storage = malloc(t->storage_bytes);
  memset(t->storage, 0xFF, t->storage_bytes);
  t->device = diopi_host;
  all_tensors[n_tensors++] = t;
  return t;
}

static void free_all(void) {
  for (int i = 0; i < n_tensors; ++i) free(all_tensors[i]->storage), free(all_tensors[i]);
  n_tensors = 0;
  ctx_reset();
}

static int64_t off_of(const T* t, int64_t lin) {
  int64_t o = 0;
  for (int d = t->nd - 1; d >= 0; --d) o += (lin % t->shape[d]) * t->stride[d], lin /= t->shape[d];
  return o;
}

static float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float f;
  if (e == 0) f = ldexpf((float)m, -24);
  else if (e == 31) f = m ? NAN : INFINITY;
  else f = ldexpf((float)(m | 0x400), (int)e - 25);
  return sign ? -f : f;
}

/* Element `lin` (row-major) as a double, read independently of the library's own conversions. */
static double get(const T* t, int64_t lin) {
  const unsigned char* q = t->storage + (t->offset + off_of(t, lin)) * esize(t->dt);
  switch (t->dt) {
    case diopi_dtype_float32: { float x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_float64: { double x; memcpy(&x, q, 8); return x; }
    case diopi_dtype_float16: { uint16_t x; memcpy(&x, q, 2); return h2f(x); }
    case diopi_dtype_bfloat16: { uint16_t x; memcpy(&x, q, 2); uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
    case diopi_dtype_int32: { int32_t x; memcpy(&x, q, 4); return x; }
    case diopi_dtype_int64: { int64_t x; memcpy(&x, q, 8); return (double)x; }
    case diopi_dtype_bool: case diopi_dtype_uint8: return *q;
    case diopi_dtype_int8: return (int8_t)*q;
    default: abort();
  }
}

/* Stores x rounded toward zero in the 16-bit dtypes (the test's values need only be representable, not nearest). */
static void set(T* t, int64_t lin, double x) {
  unsigned char* q = t->storage + (t->offset + off_of(t, lin)) * esize(t->dt);
  switch (t->dt) {
    case diopi_dtype_float32: { float y = (float)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_float64: memcpy(q, &x, 8); break;
    case diopi_dtype_bfloat16: { float y = (float)x; uint32_t u; memcpy(&u, &y, 4); uint16_t h = (uint16_t)(u >> 16); memcpy(q, &h, 2); break; }
    case diopi_dtype_float16: { /* exact for the test's values: |x| < 64 rounded to 2^-10 relative */
      float y = (float)x;
      uint16_t h = 0;
      if (y != 0) {
        int e;
        float m = frexpf(fabsf(y), &e); /* |y| = m 2^e, m in [0.5, 1) */
        if (e - 1 < -14) { h = (uint16_t)ldexpf(fabsf(y), 24); }
        else h = (uint16_t)(((uint32_t)(e - 1 + 15) << 10) | ((uint32_t)ldexpf(m * 2 - 1, 10) & 0x3ff));
        if (y < 0) h |= 0x8000;
      }
      memcpy(q, &h, 2);
      break;
    }
    case diopi_dtype_int32: { int32_t y = (int32_t)x; memcpy(q, &y, 4); break; }
    case diopi_dtype_int64: { int64_t y = (int64_t)x; memcpy(q, &y, 8); break; }
    case diopi_dtype_bool: case diopi_dtype_uint8: *q = (unsigned char)(x != 0); break;
    case diopi_dtype_int8: *q = (unsigned char)(int8_t)x; break;
    default: abort();
  }
}

static uint64_t rng_state;
static double urand(void) { /* xorshift64*, uniform in [0, 1) */
  rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) * 0x1.0p-53;
}
static int64_t irand(int64_t n) { return (int64_t)(urand() * (double)n); }

static void fill(T* t, double lo, double hi) {
  for (int64_t i = 0; i < numel(t); ++i) set(t, i, lo + (hi - lo) * urand());
}

/* The values as stored (after rounding to the dtype), row-major: the reference computes from these. */
static double* vals(const T* t) {
  double* v = malloc(sizeof(double) * (size_t)(numel(t) ? numel(t) : 1));
  for (int64_t i = 0; i < numel(t); ++i) v[i] = get(t, i);
  return v;
}

/* ---- Checking ------------------------------------------------------------------------------------------------- */

static int failures, checks;
static char case_name[256];

static void failf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "FAIL %s: ", case_name);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  ++failures;
}

static void name_case(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(case_name, sizeof case_name, fmt, ap);
  va_end(ap);
}

static double tol_of(diopiDtype_t dt) {
  switch (dt) {
    case diopi_dtype_float64: return 1e-11;
    case diopi_dtype_float32: return 2e-6;
    case diopi_dtype_float16: return 2e-3;
    case diopi_dtype_bfloat16: return 1.6e-2;
    default: return 0;
  }
}

static bool guards_intact(const T* t) {
  const int64_t es = esize(t->dt), n = numel(t);
  unsigned char* mark = calloc(t->storage_bytes, 1);
  for (int64_t i = 0; i < n; ++i) memset(mark + (t->offset + off_of(t, i)) * es, 1, (size_t)es);
  bool ok = true;
  for (size_t b = 0; b < t->storage_bytes && ok; ++b) ok = mark[b] || t->storage[b] == 0xFF;
  free(mark);
  return ok;
}

/* out must equal expect within the dtype's tolerance, relative to max(1, |expect|) scaled by `scale`. */
static bool expect_near(const char* what, const T* out, const double* expect, double scale) {
  ++checks;
  const double tol = tol_of(out->dt) * scale;
  for (int64_t i = 0; i < numel(out); ++i) {
    const double a = get(out, i), e = expect[i];
    const bool ok = (isnan(e) && isnan(a)) || (isinf(e) && a == e) || fabs(a - e) <= tol * fmax(1, fabs(e));
    if (!ok) {
      failf("%s[%lld] = %.9g, expected %.9g (tol %.3g)", what, (long long)i, a, e, tol);
      return false;
    }
  }
  if (!guards_intact(out)) {
    failf("%s: the kernel wrote outside the output's view", what);
    return false;
  }
  return true;
}

static bool expect_status(const char* what, diopiError_t got, diopiError_t want, const char* (*last_error)(void)) {
  ++checks;
  if (got == want) return true;
  failf("%s returned %d, expected %d (%s)", what, (int)got, (int)want, last_error ? last_error() : "");
  return false;
}

/* ---- The library under test ----------------------------------------------------------------------------------- */

#define FUNCS(X)                                                                                                   \
  X(diopiMm) X(diopiBmm) X(diopiAddmm) X(diopiBaddbmm) X(diopiLinear) X(diopiLinearBackward) X(diopiLayerNorm)                      \
  X(diopiLayerNormBackward) X(diopiRMSNorm) X(diopiRMSNormBackward) X(diopiSoftmax) X(diopiSoftmaxBackward)         \
  X(diopiLogSoftmax) X(diopiLogSoftmaxBackward) X(diopiGelu) X(diopiGeluBackward) X(diopiSilu) X(diopiSiluBackward) \
  X(diopiEmbedding) X(diopiEmbeddingBackward) X(diopiCrossEntropyLoss) X(diopiCrossEntropyLossBackward)              \
  X(diopiAdamW) X(diopiFlashAttention) X(diopiFlashAttentionBackward) X(diopiRotaryEmbedding) X(diopiAdd)          \
  X(diopiAddScalar) X(diopiMul) X(diopiMulScalar) X(diopiFill) X(diopiSum) X(diopiCastDtype) X(diopiCopyInp)        \
  X(diopiClipGradNorm) X(diopiDropout) X(diopiGetVendorName) X(diopiGetLastErrorString) X(diopiGetVersion)

typedef struct {
  void* handle;
#define MEMBER(f) __typeof__(&f) f;
  FUNCS(MEMBER)
#undef MEMBER
} Lib;

static bool open_lib(const char* path, Lib* lib, bool require_all) {
  memset(lib, 0, sizeof *lib);
  lib->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    fprintf(stderr, "FAIL cannot load %s: %s\n", path, dlerror());
    ++failures;
    return false;
  }
#define LOAD(f)                                                                    \
  lib->f = (__typeof__(&f))dlsym(lib->handle, #f);                                 \
  if (!lib->f && require_all) {                                                    \
    fprintf(stderr, "FAIL %s does not export %s\n", path, #f);                     \
    ++failures;                                                                    \
  }
  FUNCS(LOAD)
#undef LOAD
  return true;
}

static Lib L; /* the library the checks below call */
/* Scratch lives for one call: the previous call's is released before the next. */
#define CALL(f, ...) (ctx_reset(), L.f(&g_ctx, __VA_ARGS__))
static const int64_t kSizes[] = {1, 3, 17, 65, 5, 8};
static int64_t pick(void) { return kSizes[irand(6)]; }
static const diopiDtype_t kFloats[] = {diopi_dtype_float32, diopi_dtype_float64, diopi_dtype_float16,
                                       diopi_dtype_bfloat16};

static diopiSize_t sz(const int64_t* d, int64_t n) {
  diopiSize_t s = {d, n};
  return s;
}
static diopiScalar_t fscalar(double v) {
  diopiScalar_t s;
  s.stype = diopi_dtype_float64, s.fval = v;
  return s;
}

/* ---- Matrix products ------------------------------------------------------------------------------------------ */

static void test_matmul(diopiDtype_t dt, enum Layout la, enum Layout lb, enum Layout lo) {
  const int64_t bsz = pick() % 4 + 1, m = pick(), k = pick(), n = pick();
  const double scale = sqrt((double)k) * 2; /* a sum of k rounded products */
  {
    name_case("mm %s [%lld,%lld]x[%lld,%lld] %s/%s/%s", dt == diopi_dtype_float32 ? "f32" : "f64", (long long)m,
              (long long)k, (long long)k, (long long)n, layout_name[la], layout_name[lb], layout_name[lo]);
    int64_t sa[] = {m, k}, sb[] = {k, n}, so[] = {m, n};
    T *a = mk(dt, 2, sa, la), *b = mk(dt, 2, sb, lb), *o = mk(dt, 2, so, lo), *c = mk(dt, 1, sb + 1, lo);
    fill(a, -1, 1), fill(b, -1, 1), fill(c, -1, 1);
    double *va = vals(a), *vb = vals(b), *vc = vals(c), *e = malloc(sizeof(double) * (size_t)(m * n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += va[i * k + q] * vb[q * n + j];
        e[i * n + j] = s;
      }
    if (expect_status("diopiMm", CALL(diopiMm, o, a, b), diopiSuccess, L.diopiGetLastErrorString))
      expect_near("mm out", o, e, scale);
    /* addmm: beta * input (a broadcast row) + alpha * product */
    diopiScalar_t beta = fscalar(0.5), alpha = fscalar(-2);
    for (int64_t i = 0; i < m * n; ++i) e[i] = 0.5 * vc[i % n] - 2 * e[i];
    memset(o->storage, 0xFF, o->storage_bytes);
    if (expect_status("diopiAddmm", CALL(diopiAddmm, o, c, a, b, &beta, &alpha), diopiSuccess, L.diopiGetLastErrorString))
      expect_near("addmm out", o, e, 2 * scale);
    free(va), free(vb), free(vc), free(e);
  }
  {
    name_case("bmm [%lld,%lld,%lld]x[.,.,%lld] %s/%s/%s", (long long)bsz, (long long)m, (long long)k, (long long)n,
              layout_name[la], layout_name[lb], layout_name[lo]);
    int64_t sa[] = {bsz, m, k}, sb[] = {bsz, k, n}, so[] = {bsz, m, n};
    T *a = mk(dt, 3, sa, la), *b = mk(dt, 3, sb, lb), *o = mk(dt, 3, so, lo);
    fill(a, -1, 1), fill(b, -1, 1);
    double *va = vals(a), *vb = vals(b), *e = malloc(sizeof(double) * (size_t)(bsz * m * n));
    for (int64_t z = 0; z < bsz; ++z)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t q = 0; q < k; ++q) s += va[(z * m + i) * k + q] * vb[(z * k + q) * n + j];
          e[(z * m + i) * n + j] = s;
        }
    if (expect_status("diopiBmm", CALL(diopiBmm, o, a, b), diopiSuccess, L.diopiGetLastErrorString))
      expect_near("bmm out", o, e, scale);
    /* baddbmm in place: out = 0.75 * out + 1.5 * product, out being the input it adds */
    double* vo = vals(o);
    for (int64_t i = 0; i < bsz * m * n; ++i) e[i] = 0.75 * vo[i] + 1.5 * e[i];
    if (expect_status("diopiBaddbmm", CALL(diopiBaddbmm, o, o, a, b, 0.75, 1.5), diopiSuccess, L.diopiGetLastErrorString))
      expect_near("baddbmm out", o, e, 2 * scale);
    free(vo);
    free(va), free(vb), free(e);
  }
  free_all();
}

/* ---- Elementwise, fill, sum, copy, cast ----------------------------------------------------------------------- */

static void test_elementwise(diopiDtype_t dt, enum Layout l1, enum Layout l2) {
  const int64_t a = pick(), b = pick(), c = pick() % 7 + 1;
  int64_t so[] = {a, b, c}, sy[] = {b, 1}; /* y broadcasts over the first and last dims */
  name_case("add/mul dtype %d [%lld,%lld,%lld] %s/%s", (int)dt, (long long)a, (long long)b, (long long)c,
            layout_name[l1], layout_name[l2]);
  T *x = mk(dt, 3, so, l1), *y = mk(dt, 2, sy, l2), *o = mk(dt, 3, so, l2);
  fill(x, -4, 4), fill(y, -4, 4);
  double *vx = vals(x), *vy = vals(y), *e = malloc(sizeof(double) * (size_t)(a * b * c));
  diopiScalar_t alpha = fscalar(0.25), s = fscalar(1.5);
#define EACH for (int64_t i = 0; i < a * b * c; ++i)
#define YV vy[(i / c) % b]
  EACH e[i] = vx[i] + 0.25 * YV;
  if (expect_status("diopiAdd", CALL(diopiAdd, o, x, y, &alpha), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("add out", o, e, 2);
  EACH e[i] = vx[i] * YV;
  if (expect_status("diopiMul", CALL(diopiMul, o, x, y), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("mul out", o, e, 2);
  EACH e[i] = vx[i] + 0.25 * 1.5;
  if (expect_status("diopiAddScalar", CALL(diopiAddScalar, o, x, &s, &alpha), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("addScalar out", o, e, 2);
  EACH e[i] = vx[i] * 1.5;
  if (expect_status("diopiMulScalar", CALL(diopiMulScalar, o, x, &s), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("mulScalar out", o, e, 2);
  /* in place: out aliases input */
  EACH e[i] = vx[i] + 0.25 * YV;
  if (expect_status("diopiAdd in place", CALL(diopiAdd, x, x, y, &alpha), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("add in place", x, e, 2);
  diopiScalar_t v = fscalar(-0.375);
  EACH e[i] = -0.375;
  if (expect_status("diopiFill", CALL(diopiFill, o, &v), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("fill", o, e, 1);
  /* sum over dims {0, 2} (out [b]) and over all dims (empty list, out []) */
  int64_t dims[] = {0, -1}, sb1[] = {b};
  T* s1 = mk(dt, 1, sb1, l1);
  double* es = calloc((size_t)b, sizeof(double));
  double total = 0, *vx2 = vals(x); /* x as the in-place add left it */
  EACH es[(i / c) % b] += vx2[i], total += vx2[i];
  if (expect_status("diopiSum", CALL(diopiSum, s1, x, sz(dims, 2)), diopiSuccess, L.diopiGetLastErrorString)) {
    expect_near("sum over dims 0,-1", s1, es, (double)(a * c));
    T* s0 = mk(dt, 0, NULL, CONTIG);
    if (expect_status("diopiSum all", CALL(diopiSum, s0, x, sz(NULL, 0)), diopiSuccess, L.diopiGetLastErrorString))
      expect_near("sum over all dims", s0, &total, (double)(a * b * c));
  }
  free(vx2);
  /* copy: a broadcast source into a strided destination; cast: to another float dtype and to int32 */
  EACH e[i] = YV;
  if (expect_status("diopiCopyInp", CALL(diopiCopyInp, y, o), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("copy", o, e, 1);
  const diopiDtype_t other = dt == diopi_dtype_float64 ? diopi_dtype_float32 : diopi_dtype_float64;
  T *co = mk(other, 3, so, l1), *ci = mk(diopi_dtype_int32, 3, so, l2);
  double* vx3 = vals(x);
  if (expect_status("diopiCastDtype", CALL(diopiCastDtype, co, x), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("cast to another float dtype", co, vx3, 1);
  EACH e[i] = trunc(vx3[i]);
  if (expect_status("diopiCastDtype to int32", CALL(diopiCastDtype, ci, x), diopiSuccess, L.diopiGetLastErrorString))
    expect_near("cast to int32", ci, e, 1);
#undef EACH
#undef YV
  free(vx), free(vy), free(vx3), free(e), free(es);
  free_all();
}

static void test_int64_exact(void) {
  name_case("int64 add/copy keep all 64 bits");
  int64_t s[] = {3};
  T *x = mk(diopi_dtype_int64, 1, s, STEP2), *o = mk(diopi_dtype_int64, 1, s, PADDED);
  const int64_t big = (1ll << 60) + 12345;
  for (int i = 0; i < 3; ++i) memcpy(x->storage + (x->offset + off_of(x, i)) * 8, &(int64_t){big + i}, 8);
  diopiScalar_t one;
  one.stype = diopi_dtype_int64, one.ival = 1;
  ++checks;
  if (CALL(diopiAddScalar, o, x, &one, &one) != diopiSuccess) failf("diopiAddScalar int64 failed");
  for (int i = 0; i < 3; ++i) {
    int64_t got;
    memcpy(&got, o->storage + (o->offset + off_of(o, i)) * 8, 8);
    if (got != big + i + 1) failf("int64 add: %lld != %lld", (long long)got, (long long)(big + i + 1));
  }
  free_all();
}

/* ---- Shared helpers for the rest ------------------------------------------------------------------------------ */

static enum Layout rl(void) { return (enum Layout)irand(NLAYOUTS); }
/* Set for a round of float64 cases small enough that every backward is checked by finite differences. */
static bool g_f64_small;
static diopiDtype_t rfloat(void) { return g_f64_small ? diopi_dtype_float64 : kFloats[irand(2)]; } /* f32/f64 */
static int64_t pick_small(void) { static const int64_t s[] = {1, 3, 5, 8, 17}; return s[irand(5)]; }
#define pick() (g_f64_small ? pick_small() : pick())
static double* dalloc(int64_t n) { return calloc((size_t)(n ? n : 1), sizeof(double)); }
#define OK(what, call) expect_status(what, call, diopiSuccess, L.diopiGetLastErrorString)

/* Central differences of L = sum(out * r) with respect to every element of x (all float64), against `analytic`. */
typedef diopiError_t (*Forward)(void* state);
static void fd_check(const char* what, T* x, const T* out, const double* r, Forward f, void* state,
                     const double* analytic) {
  ++checks;
  const double h = 1e-6;
  for (int64_t i = 0; i < numel(x); ++i) {
    const double x0 = get(x, i);
    double l[2];
    for (int side = 0; side < 2; ++side) {
      set(x, i, x0 + (side ? -h : h));
      if (f(state) != diopiSuccess) { failf("%s: forward failed (%s)", what, L.diopiGetLastErrorString()); return; }
      l[side] = 0;
      for (int64_t j = 0; j < numel(out); ++j) l[side] += get(out, j) * r[j];
    }
    set(x, i, x0);
    const double numeric = (l[0] - l[1]) / (2 * h);
    if (fabs(numeric - analytic[i]) > 1e-5 * fmax(1, fabs(numeric))) {
      failf("%s: d/dx[%lld] = %.9g by the backward, %.9g by finite differences", what, (long long)i, analytic[i], numeric);
      return;
    }
  }
  f(state); /* leave out as computed from the unperturbed inputs */
}

/* ---- Linear --------------------------------------------------------------------------------------------------- */

static void test_linear(void) {
  const diopiDtype_t dt = rfloat();
  const int64_t a = pick() % 4 + 1, r = pick(), in = pick(), outf = pick();
  name_case("linear dtype %d x [%lld,%lld,%lld] w [%lld,%lld]", (int)dt, (long long)a, (long long)r, (long long)in,
            (long long)outf, (long long)in);
  int64_t sx[] = {a, r, in}, sw[] = {outf, in}, so[] = {a, r, outf};
  T *x = mk(dt, 3, sx, rl()), *w = mk(dt, 2, sw, rl()), *b = mk(dt, 1, so + 2, rl()), *o = mk(dt, 3, so, rl());
  T *g = mk(dt, 3, so, rl()), *gx = mk(dt, 3, sx, rl()), *gw = mk(dt, 2, sw, rl()), *gb = mk(dt, 1, so + 2, rl());
  fill(x, -1, 1), fill(w, -1, 1), fill(b, -1, 1), fill(g, -1, 1);
  double *vx = vals(x), *vw = vals(w), *vb = vals(b), *vg = vals(g);
  const int64_t rows = a * r;
  double *e = dalloc(rows * outf), *ex = dalloc(rows * in), *ew = dalloc(outf * in), *eb = dalloc(outf);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < outf; ++j) {
      double s = vb[j];
      for (int64_t k = 0; k < in; ++k) s += vx[i * in + k] * vw[j * in + k];
      e[i * outf + j] = s;
      eb[j] += vg[i * outf + j];
      for (int64_t k = 0; k < in; ++k) ex[i * in + k] += vg[i * outf + j] * vw[j * in + k], ew[j * in + k] += vg[i * outf + j] * vx[i * in + k];
    }
  if (OK("diopiLinear", CALL(diopiLinear, o, x, w, b))) expect_near("linear out", o, e, sqrt((double)in) * 2);
  if (OK("diopiLinearBackward", CALL(diopiLinearBackward, gx, gw, gb, g, x, w))) {
    expect_near("linear grad_input", gx, ex, sqrt((double)outf) * 2);
    expect_near("linear grad_weight", gw, ew, sqrt((double)rows) * 2);
    expect_near("linear grad_bias", gb, eb, sqrt((double)rows) * 2);
  }
  free(vx), free(vw), free(vb), free(vg), free(e), free(ex), free(ew), free(eb);
  free_all();
}

/* ---- Norms ---------------------------------------------------------------------------------------------------- */

typedef struct {
  bool rms;
  T *o, *x, *w, *b, *s1, *s2;
  diopiSize_t ns;
} NormState;

static diopiError_t norm_forward(void* p) {
  NormState* n = p;
  return n->rms ? CALL(diopiRMSNorm, n->o, n->s2, n->x, n->ns, n->w, NULL, 1e-5)
                : CALL(diopiLayerNorm, n->o, n->s1, n->s2, n->x, n->w, n->b, n->ns, 1e-5);
}

static void test_norm(bool rms, bool two_dims) {
  const diopiDtype_t dt = rfloat();
  const int64_t r = pick(), c1 = pick(), c2 = two_dims ? pick() % 4 + 1 : 1;
  name_case("%s dtype %d x [%lld,%lld%s]", rms ? "rms_norm" : "layer_norm", (int)dt, (long long)r, (long long)c1,
            two_dims ? ",c2" : "");
  int64_t sx[] = {r, c1, c2}, nd = two_dims ? 3 : 2, nsd[] = {c1, c2}, sr[] = {r};
  const int64_t cols = c1 * c2;
  NormState n = {rms, NULL, NULL, NULL, NULL, NULL, NULL, sz(nsd, two_dims ? 2 : 1)};
  n.x = mk(dt, (int)nd, sx, rl()), n.o = mk(dt, (int)nd, sx, rl()), n.w = mk(dt, (int)nd - 1, nsd, rl());
  n.b = mk(dt, (int)nd - 1, nsd, rl()), n.s1 = mk(dt, 1, sr, rl()), n.s2 = mk(dt, 1, sr, rl());
  fill(n.x, -2, 3), fill(n.w, 0.5, 1.5), fill(n.b, -1, 1);
  double *vx = vals(n.x), *vw = vals(n.w), *vb = vals(n.b), *e = dalloc(r * cols), *em = dalloc(r), *es = dalloc(r);
  for (int64_t i = 0; i < r; ++i) {
    double m = 0, v = 0;
    if (!rms) {
      for (int64_t j = 0; j < cols; ++j) m += vx[i * cols + j];
      m /= (double)cols;
    }
    for (int64_t j = 0; j < cols; ++j) v += (vx[i * cols + j] - m) * (vx[i * cols + j] - m);
    const double rs = 1 / sqrt(v / (double)cols + 1e-5);
    em[i] = m, es[i] = rs;
    for (int64_t j = 0; j < cols; ++j) e[i * cols + j] = (vx[i * cols + j] - m) * rs * vw[j] + (rms ? 0 : vb[j]);
  }
  if (OK(rms ? "diopiRMSNorm" : "diopiLayerNorm", norm_forward(&n))) {
    expect_near("norm out", n.o, e, 4);
    if (!rms) expect_near("norm mean", n.s1, em, 4);
    expect_near("norm rstd", n.s2, es, 4);
  }
  if (rms) {
    ++checks;
    if (CALL(diopiRMSNorm, n.o, n.s2, n.x, n.ns, n.w, n.b, 1e-5) != diopiNoImplement) failf("rms norm with a bias must answer diopiNoImplement");
  }
  /* backward, float64, against finite differences of the forward for x, weight and bias */
  if (dt == diopi_dtype_float64 && r * cols <= 2000) {
    T *g = mk(dt, (int)nd, sx, rl()), *gx = mk(dt, (int)nd, sx, rl()), *gw = mk(dt, (int)nd - 1, nsd, rl());
    T *gb = mk(dt, (int)nd - 1, nsd, rl());
    fill(g, -1, 1);
    double* vg = vals(g);
    norm_forward(&n);
    diopiError_t st = rms ? CALL(diopiRMSNormBackward, gx, gw, NULL, g, n.x, n.w, NULL, n.s2, n.ns, 1e-5)
                          : CALL(diopiLayerNormBackward, gx, gw, gb, g, n.x, n.w, n.b, n.s1, n.s2, n.ns);
    if (OK("norm backward", st)) {
      double *ax = vals(gx), *aw = vals(gw), *ab = vals(gb);
      fd_check("norm grad_input", n.x, n.o, vg, norm_forward, &n, ax);
      fd_check("norm grad_weight", n.w, n.o, vg, norm_forward, &n, aw);
      if (!rms) fd_check("norm grad_bias", n.b, n.o, vg, norm_forward, &n, ab);
      free(ax), free(aw), free(ab);
    }
    free(vg);
  }
  free(vx), free(vw), free(vb), free(e), free(em), free(es);
  free_all();
}

/* ---- Softmax, log-softmax ------------------------------------------------------------------------------------- */

typedef struct {
  bool log_space;
  T *o, *x;
  int64_t dim;
} SoftmaxState;

static diopiError_t softmax_forward(void* p) {
  SoftmaxState* s = p;
  return s->log_space ? CALL(diopiLogSoftmax, s->o, s->x, s->dim) : CALL(diopiSoftmax, s->o, s->x, s->dim);
}

/* The softmax along `dim` of a row-major [a, b, c] array. */
static void softmax_ref(const double* x, const int64_t* shape, int dim, bool log_space, double* y) {
  const int64_t n = shape[0] * shape[1] * shape[2], len = shape[dim];
  const int64_t step = dim == 2 ? 1 : dim == 1 ? shape[2] : shape[1] * shape[2];
  for (int64_t i = 0; i < n; ++i) {
    if ((i / step) % len) continue; /* i is the first element of its row */
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < len; ++j) mx = fmax(mx, x[i + j * step]);
    for (int64_t j = 0; j < len; ++j) s += exp(x[i + j * step] - mx);
    for (int64_t j = 0; j < len; ++j)
      y[i + j * step] = log_space ? x[i + j * step] - mx - log(s) : exp(x[i + j * step] - mx) / s;
  }
}

/* Returns whether the forward matched (for the wrong variant's check). */
static bool test_softmax(bool log_space, int64_t row_len, bool quiet) {
  const diopiDtype_t dt = quiet ? diopi_dtype_float64 : rfloat();
  int64_t shape[] = {pick() % 5 + 1, pick(), pick() % 9 + 1};
  const int dim = (int)irand(3);
  if (row_len) shape[dim] = row_len;
  name_case("%s dtype %d [%lld,%lld,%lld] dim %d", log_space ? "log_softmax" : "softmax", (int)dt, (long long)shape[0],
            (long long)shape[1], (long long)shape[2], dim);
  SoftmaxState s = {log_space, NULL, NULL, irand(2) ? dim : dim - 3};
  s.x = mk(dt, 3, shape, rl()), s.o = mk(dt, 3, shape, rl());
  fill(s.x, -5, 5);
  const int64_t n = shape[0] * shape[1] * shape[2];
  double *vx = vals(s.x), *e = dalloc(n);
  softmax_ref(vx, shape, dim, log_space, e);
  bool ok = false;
  if (quiet) {
    ok = softmax_forward(&s) == diopiSuccess;
    for (int64_t i = 0; i < n && ok; ++i) ok = fabs(get(s.o, i) - e[i]) <= 1e-9 * fmax(1, fabs(e[i]));
  } else if (OK("softmax", softmax_forward(&s))) {
    ok = expect_near("softmax out", s.o, e, 4);
    if (dt == diopi_dtype_float64 && n <= 2000) {
      T *g = mk(dt, 3, shape, rl()), *gx = mk(dt, 3, shape, rl());
      fill(g, -1, 1);
      double* vg = vals(g);
      diopiError_t st = log_space ? CALL(diopiLogSoftmaxBackward, gx, g, s.o, s.dim) : CALL(diopiSoftmaxBackward, gx, g, s.o, s.dim);
      if (OK("softmax backward", st)) {
        double* a = vals(gx);
        fd_check("softmax grad_input", s.x, s.o, vg, softmax_forward, &s, a);
        free(a);
      }
      free(vg);
    }
  }
  free(vx), free(e);
  free_all();
  return ok;
}

/* ---- Activations ---------------------------------------------------------------------------------------------- */

typedef struct {
  int kind; /* 0 gelu, 1 gelu tanh, 2 silu */
  T *o, *x;
} ActState;

static diopiError_t act_forward(void* p) {
  ActState* a = p;
  return a->kind == 2 ? CALL(diopiSilu, a->o, a->x) : CALL(diopiGelu, a->o, a->x, a->kind ? "tanh" : "none");
}

static void test_activation(int kind) {
  const diopiDtype_t dt = rfloat();
  int64_t shape[] = {pick(), pick() % 9 + 1};
  name_case("%s dtype %d [%lld,%lld]", kind == 2 ? "silu" : kind ? "gelu tanh" : "gelu", (int)dt, (long long)shape[0],
            (long long)shape[1]);
  ActState a = {kind, NULL, NULL};
  a.x = mk(dt, 2, shape, rl()), a.o = mk(dt, 2, shape, rl());
  fill(a.x, -6, 6);
  const int64_t n = shape[0] * shape[1];
  double *vx = vals(a.x), *e = dalloc(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = vx[i];
    e[i] = kind == 2 ? x / (1 + exp(-x))
         : kind ? 0.5 * x * (1 + tanh(0.79788456080286535588 * (x + 0.044715 * x * x * x))) : 0.5 * x * (1 + erf(x / sqrt(2)));
  }
  if (OK("activation", act_forward(&a))) expect_near("activation out", a.o, e, 2);
  if (dt == diopi_dtype_float64) {
    T *g = mk(dt, 2, shape, rl()), *gx = mk(dt, 2, shape, rl());
    fill(g, -1, 1);
    double* vg = vals(g);
    diopiError_t st = kind == 2 ? CALL(diopiSiluBackward, gx, g, a.x) : CALL(diopiGeluBackward, gx, g, a.x, kind ? "tanh" : "none");
    if (OK("activation backward", st)) {
      double* an = vals(gx);
      fd_check("activation grad_input", a.x, a.o, vg, act_forward, &a, an);
      free(an);
    }
    free(vg);
  }
  ++checks;
  if (CALL(diopiGelu, a.o, a.x, "sigmoid") != diopiErrorOccurred) failf("gelu with approximate \"sigmoid\" must fail");
  free(vx), free(e);
  free_all();
}

/* ---- Embedding ------------------------------------------------------------------------------------------------ */

static void test_embedding(void) {
  const diopiDtype_t dt = rfloat();
  const diopiDtype_t it = irand(2) ? diopi_dtype_int64 : diopi_dtype_int32;
  const int64_t v = pick() + 2, d = pick(), a = pick() % 4 + 1, b = pick();
  name_case("embedding dtype %d vocab %lld dim %lld indices [%lld,%lld]", (int)dt, (long long)v, (long long)d,
            (long long)a, (long long)b);
  int64_t sw[] = {v, d}, si[] = {a, b}, so[] = {a, b, d};
  T *w = mk(dt, 2, sw, rl()), *idx = mk(it, 2, si, rl()), *o = mk(dt, 3, so, rl()), *g = mk(dt, 3, so, rl());
  T* gw = mk(dt, 2, sw, rl());
  fill(w, -1, 1), fill(g, -1, 1);
  for (int64_t i = 0; i < a * b; ++i) set(idx, i, (double)irand(v));
  double *vw = vals(w), *vi = vals(idx), *vg = vals(g), *e = dalloc(a * b * d), *eg = dalloc(v * d), *cnt = dalloc(v);
  const int64_t pad = (int64_t)vi[0]; /* make sure the padding row is used */
  for (int64_t p = 0; p < a * b; ++p) cnt[(int64_t)vi[p]] += 1;
  for (int64_t p = 0; p < a * b; ++p)
    for (int64_t j = 0; j < d; ++j) {
      const int64_t row = (int64_t)vi[p];
      e[p * d + j] = vw[row * d + j];
      if (row != pad) eg[row * d + j] += vg[p * d + j] / cnt[row];
    }
  if (OK("diopiEmbedding", CALL(diopiEmbedding, o, w, idx, pad, true, false))) expect_near("embedding out", o, e, 1);
  if (OK("diopiEmbeddingBackward", CALL(diopiEmbeddingBackward, gw, g, idx, v, pad, true, false)))
    expect_near("embedding grad (padding_idx, scale_grad_byfreq)", gw, eg, sqrt((double)(a * b)) * 2);
  set(idx, a * b - 1, (double)v);
  ++checks;
  if (CALL(diopiEmbedding, o, w, idx, -1, false, false) != diopiErrorOccurred ||
      !strstr(L.diopiGetLastErrorString(), "out of range"))
    failf("an out-of-range index must fail with a message naming it (got \"%s\")", L.diopiGetLastErrorString());
  free(vw), free(vi), free(vg), free(e), free(eg), free(cnt);
  free_all();
}

/* ---- Cross entropy -------------------------------------------------------------------------------------------- */

typedef struct {
  T *o, *x, *t, *w;
  diopiReduction_t red;
  int64_t ignore;
} XentState;

static diopiError_t xent_forward(void* p) {
  XentState* s = p;
  return CALL(diopiCrossEntropyLoss, s->o, s->x, s->t, s->w, s->red, s->ignore, 0.0);
}

static void test_cross_entropy(bool spatial, int reduction) {
  const diopiDtype_t dt = rfloat();
  const int64_t n = pick(), c = pick() + 1, sp = spatial ? pick() % 4 + 1 : 1;
  XentState s = {NULL, NULL, NULL, NULL, (diopiReduction_t)reduction, -100};
  name_case("cross_entropy dtype %d [%lld,%lld%s] reduction %d", (int)dt, (long long)n, (long long)c,
            spatial ? ",d" : "", (int)s.red);
  int64_t sx[] = {n, c, sp}, st_[] = {n, sp}, one = 1;
  const int nd = spatial ? 3 : 2;
  s.x = mk(dt, nd, sx, rl()), s.t = mk(diopi_dtype_int64, nd - 1, st_, rl());
  s.w = irand(2) ? mk(dt, 1, &sx[1], rl()) : NULL;
  s.o = s.red == ReductionNone ? mk(dt, nd - 1, st_, rl()) : mk(dt, 0, &one, CONTIG);
  fill(s.x, -3, 3);
  if (s.w) fill(s.w, 0.5, 2);
  const int64_t pos = n * sp;
  for (int64_t p = 0; p < pos; ++p) set(s.t, p, p % 5 == 3 ? -100 : (double)irand(c)); /* some ignored */
  double *vx = vals(s.x), *vt = vals(s.t), *vw = s.w ? vals(s.w) : NULL, *e = dalloc(pos);
  double total = 0, wsum = 0;
  for (int64_t p = 0; p < pos; ++p) { /* position p = (i, k): logits x[i, :, k] */
    const int64_t i = p / sp, k = p % sp, t = (int64_t)vt[p];
    if (t == -100) continue;
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < c; ++j) mx = fmax(mx, vx[(i * c + j) * sp + k]);
    for (int64_t j = 0; j < c; ++j) sum += exp(vx[(i * c + j) * sp + k] - mx);
    const double w = vw ? vw[t] : 1;
    e[p] = -w * (vx[(i * c + t) * sp + k] - mx - log(sum));
    total += e[p], wsum += w;
  }
  if (s.red != ReductionNone) e[0] = s.red == ReductionMean ? total / wsum : total;
  if (OK("diopiCrossEntropyLoss", xent_forward(&s))) expect_near("cross entropy out", s.o, e, 2 * sqrt((double)pos));
  if (dt == diopi_dtype_float64 && pos * c <= 2000) {
    T *g = s.red == ReductionNone ? mk(dt, nd - 1, st_, rl()) : mk(dt, 0, &one, CONTIG), *gx = mk(dt, nd, sx, rl());
    fill(g, 0.5, 1.5);
    double* vg = vals(g);
    if (OK("diopiCrossEntropyLossBackward",
           CALL(diopiCrossEntropyLossBackward, gx, g, s.x, s.t, s.w, s.red, s.ignore, 0.0))) {
      double* a = vals(gx);
      fd_check("cross entropy grad_input", s.x, s.o, vg, xent_forward, &s, a);
      free(a);
    }
    free(vg);
  }
  ++checks;
  if (CALL(diopiCrossEntropyLoss, s.o, s.x, s.t, s.w, s.red, s.ignore, 0.1) != diopiNoImplement)
    failf("label smoothing must answer diopiNoImplement");
  free(vx), free(vt), free(vw), free(e);
  free_all();
}

/* ---- AdamW ---------------------------------------------------------------------------------------------------- */

static void test_adamw(bool amsgrad) {
  const diopiDtype_t dt = rfloat();
  int64_t shape[] = {pick(), pick() % 7 + 1};
  name_case("adamw dtype %d amsgrad %d [%lld,%lld]", (int)dt, amsgrad, (long long)shape[0], (long long)shape[1]);
  T *p = mk(dt, 2, shape, rl()), *g = mk(dt, 2, shape, rl()), *m = mk(dt, 2, shape, rl()), *v = mk(dt, 2, shape, rl());
  T* mx = mk(dt, 2, shape, rl());
  fill(p, -1, 1), fill(m, -0.1, 0.1), fill(v, 0, 0.01), fill(mx, 0, 0.02);
  const int64_t n = shape[0] * shape[1];
  double *ep = vals(p), *em = vals(m), *ev = vals(v), *emx = vals(mx);
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    fill(g, -1, 1);
    double* vg = vals(g);
    for (int64_t i = 0; i < n; ++i) {
      ep[i] *= 1 - (double)lr * wd;
      em[i] = (double)b1 * em[i] + (1 - (double)b1) * vg[i];
      ev[i] = (double)b2 * ev[i] + (1 - (double)b2) * vg[i] * vg[i];
      if (amsgrad) emx[i] = fmax(emx[i], ev[i]);
      const double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
      ep[i] -= (double)lr / bc1 * em[i] / (sqrt(amsgrad ? emx[i] : ev[i]) / sqrt(bc2) + eps);
    }
    free(vg);
    if (!OK("diopiAdamW", CALL(diopiAdamW, p, g, m, v, amsgrad ? mx : NULL, lr, b1, b2, eps, wd, step, amsgrad))) break;
    /* compare, then continue from the stored (rounded) state as the kernel does */
    expect_near("adamw param", p, ep, 4);
    expect_near("adamw exp_avg", m, em, 4);
    expect_near("adamw exp_avg_sq", v, ev, 4);
    if (amsgrad) expect_near("adamw max_exp_avg_sq", mx, emx, 4);
    free(ep), free(em), free(ev), free(emx);
    ep = vals(p), em = vals(m), ev = vals(v), emx = vals(mx);
  }
  free(ep), free(em), free(ev), free(emx);
  free_all();
}

/* ---- Attention ------------------------------------------------------------------------------------------------ */

typedef struct {
  T *o, *lse, *q, *k, *v;
  float scale;
  bool causal;
  int32_t wl, wr;
} AttnState;

static diopiError_t attn_forward(void* p) {
  AttnState* a = p;
  return CALL(diopiFlashAttention, a->o, a->lse, NULL, a->q, a->k, a->v, NULL, 0.0f, a->scale, a->causal, a->wl, a->wr);
}

static void test_attention(bool causal, bool window, bool small, bool gqa) {
  const diopiDtype_t dt = small ? diopi_dtype_float64 : rfloat();
  const int64_t b = irand(2) + 1, hk = irand(2) + 1, h = hk * (gqa ? 2 : 1), d = small ? irand(4) + 1 : pick();
  const int64_t tk = small ? irand(5) + 1 : pick(), tq = irand(2) ? tk : (small ? irand(5) + 1 : pick());
  AttnState a = {NULL, NULL, NULL, NULL, NULL, (float)(1 / sqrt((double)d)), causal, window ? (int32_t)irand(3) : -1,
                 window ? (int32_t)irand(3) : -1};
  if (causal) a.wr = -1;
  name_case("attention dtype %d b %lld tq %lld tk %lld h %lld hk %lld d %lld causal %d window %d,%d", (int)dt,
            (long long)b, (long long)tq, (long long)tk, (long long)h, (long long)hk, (long long)d, causal, a.wl, a.wr);
  int64_t sq[] = {b, tq, h, d}, skv[] = {b, tk, hk, d}, sl[] = {b, h, tq};
  a.q = mk(dt, 4, sq, rl()), a.k = mk(dt, 4, skv, rl()), a.v = mk(dt, 4, skv, rl()), a.o = mk(dt, 4, sq, rl());
  a.lse = mk(diopi_dtype_float32, 3, sl, rl());
  fill(a.q, -1, 1), fill(a.k, -1, 1), fill(a.v, -1, 1);
  double *vq = vals(a.q), *vk = vals(a.k), *vv = vals(a.v), *e = dalloc(b * tq * h * d), *el = dalloc(b * h * tq);
  double* sc = dalloc(tk);
  for (int64_t z = 0; z < b; ++z)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t i = 0; i < tq; ++i) {
        const int64_t kh = y / (h / hk), diag = i + tk - tq;
        double mx = -INFINITY, s = 0;
        for (int64_t j = 0; j < tk; ++j) {
          const bool vis = !(causal && j > diag) && !(a.wl >= 0 && j < diag - a.wl) && !(a.wr >= 0 && j > diag + a.wr);
          sc[j] = -INFINITY;
          if (vis) {
            double dp = 0;
            for (int64_t t = 0; t < d; ++t) dp += vq[((z * tq + i) * h + y) * d + t] * vk[((z * tk + j) * hk + kh) * d + t];
            sc[j] = dp * a.scale;
          }
          mx = fmax(mx, sc[j]);
        }
        el[(z * h + y) * tq + i] = INFINITY;
        if (mx == -INFINITY) continue; /* out 0 */
        for (int64_t j = 0; j < tk; ++j) s += exp(sc[j] - mx);
        el[(z * h + y) * tq + i] = mx + log(s);
        for (int64_t j = 0; j < tk; ++j)
          for (int64_t t = 0; t < d; ++t)
            e[((z * tq + i) * h + y) * d + t] += exp(sc[j] - mx) / s * vv[((z * tk + j) * hk + kh) * d + t];
      }
  if (OK("diopiFlashAttention", attn_forward(&a))) {
    expect_near("attention out", a.o, e, 4);
    expect_near("attention softmax_lse", a.lse, el, 4);
  }
  if (small) {
    T *g = mk(dt, 4, sq, rl()), *gq = mk(dt, 4, sq, rl()), *gk = mk(dt, 4, skv, rl()), *gv = mk(dt, 4, skv, rl());
    fill(g, -1, 1);
    double* vg = vals(g);
    if (OK("diopiFlashAttentionBackward", CALL(diopiFlashAttentionBackward, gq, gk, gv, g, NULL, a.q, a.k, a.v, NULL,
                                               a.o, a.lse, 0.0f, a.scale, a.causal, a.wl, a.wr))) {
      double *aq = vals(gq), *ak = vals(gk), *av = vals(gv);
      fd_check("attention grad_q", a.q, a.o, vg, attn_forward, &a, aq);
      fd_check("attention grad_k", a.k, a.o, vg, attn_forward, &a, ak);
      fd_check("attention grad_v", a.v, a.o, vg, attn_forward, &a, av);
      free(aq), free(ak), free(av);
    }
    /* The backward takes P from the given lse and the row term from the given out (FlashAttention's contract):
     * with an lse and an out unrelated to q, k and v, it must follow them. */
    T *lse2 = mk(diopi_dtype_float64, 3, sl, rl()), *o2 = mk(dt, 4, sq, rl());
    fill(lse2, 0, 2), fill(o2, -1, 1);
    double *vl2 = vals(lse2), *vo2 = vals(o2), *eq = dalloc(b * tq * h * d), *ek = dalloc(b * tk * hk * d);
    double* ev = dalloc(b * tk * hk * d);
    for (int64_t z = 0; z < b; ++z)
      for (int64_t y = 0; y < h; ++y)
        for (int64_t i = 0; i < tq; ++i) {
          const int64_t kh = y / (h / hk), diag = i + tk - tq, qi = ((z * tq + i) * h + y) * d;
          double rowterm = 0;
          for (int64_t t = 0; t < d; ++t) rowterm += vg[qi + t] * vo2[qi + t];
          for (int64_t j = 0; j < tk; ++j) {
            const bool vis = !(causal && j > diag) && !(a.wl >= 0 && j < diag - a.wl) && !(a.wr >= 0 && j > diag + a.wr);
            if (!vis) continue;
            const int64_t kj = ((z * tk + j) * hk + kh) * d;
            double s = 0, dpv = 0;
            for (int64_t t = 0; t < d; ++t) s += vq[qi + t] * vk[kj + t], dpv += vg[qi + t] * vv[kj + t];
            const double pr = exp(s * a.scale - vl2[(z * h + y) * tq + i]), ds = pr * (dpv - rowterm) * a.scale;
            for (int64_t t = 0; t < d; ++t) {
              eq[qi + t] += ds * vk[kj + t], ek[kj + t] += ds * vq[qi + t], ev[kj + t] += pr * vg[qi + t];
            }
          }
        }
    if (OK("diopiFlashAttentionBackward with a given lse and out",
           CALL(diopiFlashAttentionBackward, gq, gk, gv, g, NULL, a.q, a.k, a.v, NULL, o2, lse2, 0.0f, a.scale,
                a.causal, a.wl, a.wr))) {
      expect_near("attention grad_q from the given lse and out", gq, eq, 8);
      expect_near("attention grad_k from the given lse and out", gk, ek, 8);
      expect_near("attention grad_v from the given lse and out", gv, ev, 8);
    }
    free(vl2), free(vo2), free(eq), free(ek), free(ev);
    free(vg);
  }
  ++checks;
  if (CALL(diopiFlashAttention, a.o, a.lse, NULL, a.q, a.k, a.v, NULL, 0.1f, a.scale, causal, -1, -1) != diopiNoImplement)
    failf("attention dropout must answer diopiNoImplement");
  free(vq), free(vk), free(vv), free(e), free(el), free(sc);
  free_all();
}

/* ---- Rotary embedding ----------------------------------------------------------------------------------------- */

static void test_rotary(bool interleaved) {
  const diopiDtype_t dt = rfloat();
  const int64_t b = irand(2) + 1, t = pick(), h = irand(3) + 1, half = pick() % 9 + 1, d = 2 * half;
  name_case("rotary dtype %d x [%lld,%lld,%lld,%lld] interleaved %d", (int)dt, (long long)b, (long long)t, (long long)h,
            (long long)d, interleaved);
  int64_t sx[] = {b, t, h, d}, sc[] = {t, 1, half};
  T *x = mk(dt, 4, sx, rl()), *o = mk(dt, 4, sx, rl()), *c = mk(dt, 3, sc, rl()), *s = mk(dt, 3, sc, rl());
  T* back = mk(dt, 4, sx, rl());
  fill(x, -2, 2);
  for (int64_t i = 0; i < t * half; ++i) {
    const double ang = (double)(i / half) * pow(10000, -(double)(i % half) / (double)half);
    set(c, i, cos(ang)), set(s, i, sin(ang));
  }
  const int64_t n = b * t * h * d;
  double *vx = vals(x), *vc = vals(c), *vs = vals(s), *e = dalloc(n);
  for (int64_t row = 0; row < n / d; ++row) {
    const int64_t pos = (row / h) % t;
    for (int64_t j = 0; j < half; ++j) {
      const int64_t i1 = row * d + (interleaved ? 2 * j : j), i2 = row * d + (interleaved ? 2 * j + 1 : j + half);
      const double cc = vc[pos * half + j], ss = vs[pos * half + j];
      e[i1] = vx[i1] * cc - vx[i2] * ss, e[i2] = vx[i1] * ss + vx[i2] * cc;
    }
  }
  if (OK("diopiRotaryEmbedding", CALL(diopiRotaryEmbedding, o, x, c, s, false, interleaved))) {
    expect_near("rotary out", o, e, 4);
    /* conj undoes the rotation */
    if (OK("diopiRotaryEmbedding conj", CALL(diopiRotaryEmbedding, back, o, c, s, true, interleaved)))
      expect_near("rotary conj(rotary(x)) == x", back, vx, 8);
  }
  free(vx), free(vc), free(vs), free(e);
  free_all();
}

/* ---- Gradient clipping and dropout ---------------------------------------------------------------------------- */

static void test_clip_grad_norm(double norm_type, double max_norm) {
  const diopiDtype_t dt = rfloat();
  name_case("clip_grad_norm dtype %d norm %g max %g", (int)dt, norm_type, max_norm);
  int64_t s1[] = {pick(), pick()}, s2[] = {pick()};
  T *g1 = mk(dt, 2, s1, rl()), *g2 = mk(dt, 1, s2, rl());
  fill(g1, -1, 1), fill(g2, -2, 2);
  double *v1 = vals(g1), *v2 = vals(g2), acc = 0;
  const int64_t n1 = s1[0] * s1[1], n2 = s2[0];
  for (int64_t i = 0; i < n1 + n2; ++i) {
    const double x = fabs(i < n1 ? v1[i] : v2[i - n1]);
    acc = isinf(norm_type) ? fmax(acc, x) : acc + pow(x, norm_type);
  }
  const double total = isinf(norm_type) ? acc : pow(acc, 1 / norm_type), coef = fmin(1, max_norm / (total + 1e-6));
  for (int64_t i = 0; i < n1; ++i) v1[i] *= coef;
  for (int64_t i = 0; i < n2; ++i) v2[i] *= coef;
  diopiTensorHandle_t grads[] = {g1, g2};
  double out = -1;
  if (OK("diopiClipGradNorm", CALL(diopiClipGradNorm, &out, grads, 2, max_norm, norm_type, false))) {
    ++checks;
    if (fabs(out - total) > 1e-5 * total) failf("total norm %.9g, expected %.9g", out, total);
    expect_near("clipped grad 1", g1, v1, 2);
    expect_near("clipped grad 2", g2, v2, 2);
  }
  set(g2, 0, INFINITY);
  ++checks;
  if (CALL(diopiClipGradNorm, &out, grads, 2, max_norm, norm_type, true) != diopiErrorOccurred)
    failf("a non-finite norm with error_if_nonfinite must fail");
  free(v1), free(v2);
  free_all();
}

static void test_dropout(void) {
  const diopiDtype_t dt = rfloat();
  int64_t shape[] = {65, 33};
  name_case("dropout dtype %d", (int)dt);
  T *x = mk(dt, 2, shape, rl()), *o = mk(dt, 2, shape, rl()), *m = mk(diopi_dtype_bool, 2, shape, rl());
  T *o2 = mk(dt, 2, shape, rl()), *m2 = mk(diopi_dtype_bool, 2, shape, rl());
  fill(x, 1, 2);
  const double p = 0.3;
  const int64_t n = shape[0] * shape[1];
  struct diopiGenerator gen = {1234, 10};
  if (!OK("diopiDropout", CALL(diopiDropout, o, m, x, p, true, &gen))) goto done;
  ++checks;
  if (gen.seed != 1234 || gen.offset != 10 + (uint64_t)n) failf("dropout must advance the generator's offset by numel");
  int64_t kept = 0;
  double* vx = vals(x);
  double* e = dalloc(n);
  for (int64_t i = 0; i < n; ++i) {
    const bool k = get(m, i) != 0;
    kept += k;
    e[i] = k ? vx[i] / (1 - p) : 0;
  }
  expect_near("dropout out = x * mask / (1 - p)", o, e, 2);
  ++checks;
  const double frac = (double)kept / (double)n; /* 2145 draws: the kept fraction is 0.7 +- 0.01 (1 sigma) */
  if (fabs(frac - 0.7) > 0.05) failf("dropout kept %.3f of the elements, expected about 0.7", frac);
  gen.offset = 10; /* the same (seed, offset) repeats the mask; the next offset does not */
  OK("diopiDropout again", CALL(diopiDropout, o2, m2, x, p, true, &gen));
  int64_t same = 0;
  for (int64_t i = 0; i < n; ++i) same += get(m, i) == get(m2, i);
  ++checks;
  if (same != n) failf("dropout with the same seed and offset gave a different mask");
  OK("diopiDropout next", CALL(diopiDropout, o2, m2, x, p, true, &gen));
  same = 0;
  for (int64_t i = 0; i < n; ++i) same += get(m, i) == get(m2, i);
  ++checks;
  if (same == n) failf("dropout at the next offset repeated the mask");
  if (OK("diopiDropout eval", CALL(diopiDropout, o, m, x, p, false, &gen))) expect_near("dropout in eval mode", o, vx, 1);
  free(vx), free(e);
done:
  free_all();
}

/* ---- Bad inputs, device tensors, the variants ----------------------------------------------------------------- */

static void test_errors(void) {
  name_case("errors");
  int64_t sa[] = {3, 4}, sb[] = {5, 2}, so[] = {3, 2};
  T *a = mk(diopi_dtype_float32, 2, sa, CONTIG), *b = mk(diopi_dtype_float32, 2, sb, CONTIG);
  T* o = mk(diopi_dtype_float32, 2, so, CONTIG);
  fill(a, 0, 1), fill(b, 0, 1);
  ++checks;
  if (CALL(diopiMm, o, a, b) != diopiErrorOccurred || !strstr(L.diopiGetLastErrorString(), "diopiMm"))
    failf("mm of [3,4] x [5,2] must fail with a message naming diopiMm (got \"%s\")", L.diopiGetLastErrorString());
  b->shape[0] = 4;
  b->device = diopi_device;
  ++checks;
  if (CALL(diopiMm, o, a, b) != diopiNoImplement) failf("a device tensor must answer diopiNoImplement");
  b->device = diopi_host;
  T* ints = mk(diopi_dtype_int32, 2, sa, CONTIG);
  ++checks;
  if (CALL(diopiSoftmax, ints, ints, 1) != diopiDtypeNotSupported) failf("softmax of int32 must answer diopiDtypeNotSupported");
  free_all();
}

static void test_wrong_variant(const char* path) {
  Lib saved = L, w;
  if (!open_lib(path, &w, true)) return;
  L = w;
  int caught = 0, passed = 0;
  for (int i = 0; i < 6; ++i) caught += !test_softmax(false, 8 * (i % 3) + 5, true); /* rows of 5, 13, 21 */
  for (int i = 0; i < 6; ++i) passed += test_softmax(false, 8 * (i % 3) + 4, true);  /* rows of 4, 12, 20 */
  name_case("wrong variant");
  ++checks;
  if (caught != 6) failf("the wrong softmax went unnoticed on %d of 6 shapes with rows %% 8 == 5", 6 - caught);
  ++checks;
  if (passed != 6) failf("the wrong softmax should be right when rows %% 8 != 5 (right on %d of 6)", passed);
  ++checks;
  if (strcmp(L.diopiGetVendorName(), "diopi_sample_wrong")) failf("wrong variant's vendor name is %s", L.diopiGetVendorName());
  L = saved;
}

static void test_partial_variant(const char* path) {
  Lib saved = L, p;
  if (!open_lib(path, &p, false)) return;
  L = p;
  name_case("partial variant");
  ++checks;
  if (p.diopiLayerNorm || dlsym(p.handle, "diopiLayerNormBackward")) failf("the partial build must not export layer norm");
  ++checks;
  if (!p.diopiMm || !p.diopiSoftmax || !p.diopiGeluBackward) { failf("the partial build lacks mm, softmax or gelu backward"); return; }
  int64_t s[] = {3, 3};
  T *a = mk(diopi_dtype_float64, 2, s, CONTIG), *b = mk(diopi_dtype_float32, 2, s, CONTIG);
  T* o = mk(diopi_dtype_float32, 2, s, CONTIG);
  fill(a, 0, 1), fill(b, 0, 1);
  expect_status("partial mm float64", CALL(diopiMm, a, a, a), diopiDtypeNotSupported, p.diopiGetLastErrorString);
  expect_status("partial mm float32", CALL(diopiMm, o, b, b), diopiSuccess, p.diopiGetLastErrorString);
  expect_status("partial gelu backward", CALL(diopiGeluBackward, o, b, b, "none"), diopiForceFallbackToCPU,
                p.diopiGetLastErrorString);
  free_all();
  L = saved;
}

static void run_part2(const char* wrong, const char* partial) {
  for (int rep = 0; rep < 4; ++rep) {
    test_linear();
    test_norm(false, rep % 2), test_norm(true, rep % 2);
    test_softmax(false, 0, false), test_softmax(true, 0, false);
    test_activation(0), test_activation(1), test_activation(2);
    test_embedding();
    test_cross_entropy(rep % 2, (int)irand(3));
    test_adamw(rep % 2);
    test_attention(rep % 2, rep >= 2, false, irand(2)), test_attention(rep % 2, rep >= 2, true, irand(2));
    test_rotary(rep % 2);
    test_clip_grad_norm(rep % 2 ? 2 : INFINITY, rep < 2 ? 0.5 : 1e6);
  }
  g_f64_small = true; /* every backward against finite differences */
  for (int rep = 0; rep < 2; ++rep) {
    test_norm(false, rep), test_norm(true, rep);
    test_softmax(false, 0, false), test_softmax(true, 0, false);
    for (int k = 0; k < 3; ++k) test_activation(k), test_cross_entropy(rep, k);
    test_attention(rep, false, true, true), test_attention(!rep, true, true, rep);
  }
  g_f64_small = false;
  test_clip_grad_norm(1.5, 0.1);
  test_dropout();
  test_errors();
  test_wrong_variant(wrong);
  test_partial_variant(partial);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s LIB WRONG_LIB PARTIAL_LIB\n", argv[0]);
    return 2;
  }
  const char* seed_env = getenv("DIOPI_SELFTEST_SEED");
  const uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
  rng_state = seed * 2654435761u + 88172645463325252ull;
  printf("diopi_sample_selftest: seed %llu (DIOPI_SELFTEST_SEED to repeat)\n", (unsigned long long)seed);
  if (!open_lib(argv[1], &L, true)) return 1;
  printf("vendor %s, %s\n", L.diopiGetVendorName(), L.diopiGetVersion());
  for (int rep = 0; rep < 3; ++rep)
    for (int d = 0; d < 2; ++d)
      for (int la = 0; la < NLAYOUTS; ++la) test_matmul(kFloats[d], (enum Layout)la, (enum Layout)((la + rep) % NLAYOUTS),
                                                         (enum Layout)((la + 2 * rep + 1) % NLAYOUTS));
  test_matmul(diopi_dtype_float16, PADDED, COLMAJOR, STEP2);
  test_matmul(diopi_dtype_bfloat16, CONTIG, STEP2, PADDED);
  for (int d = 0; d < 4; ++d)
    for (int l = 0; l < NLAYOUTS; ++l) test_elementwise(kFloats[d], (enum Layout)l, (enum Layout)((l + 1) % NLAYOUTS));
  test_int64_exact();
  run_part2(argv[2], argv[3]);
  printf("%d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
