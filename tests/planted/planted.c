/* planted: a CPU kernel library for testing the conformance suite. Its kernels (gemm with epilogues none and bias,
 * add, mul, relu, softmax, layer_norm, rope and rope_strided, adamw_update; f32 and bf16) are correct, except for ONE
 * deliberately wrong kernel chosen by the environment variable LOOM_PLANTED, read at init:
 *
 *   none (or unset)     every kernel is correct: the suite must pass this library
 *   gemm_residue        gemm is wrong when m % 7 == 3
 *   gemm_beta           gemm is wrong when beta != 0
 *   gemm_trans          gemm is wrong when trans_b is set
 *   add_bf16            add is wrong in bf16 only
 *   add_strided         add is wrong when input b is not contiguous
 *   mul_oob             mul writes one element past the end of out
 *   relu_input          relu writes into its input
 *   softmax_long        softmax is wrong for rows longer than 4096
 *   layer_norm_residue  layer_norm is wrong when C % 8 == 5
 *   add_nan             add turns a NaN input into 0 (a special value)
 *   add_alias           add is wrong when out is the same memory as b (an output aliasing an input)
 *   softmax_overflow    softmax skips the max subtraction: exp overflows in f32 at logits near 100
 *   softmax_masked      softmax writes zeros for a fully masked row (every logit -inf) instead of NaN
 *   gemm_align          gemm reads A from its pointer rounded down to 16 bytes (an unaligned view start)
 *   gemm_stride0        gemm reuses batch 0's product when A's or B's batch stride is 0 (it should need both)
 *   gemm_bias_long      gemm drops the bias epilogue when k > 256 (an attribute wrong only at a long size)
 *   gemm_alpha0         gemm leaves C untouched when alpha == 0 (right only for beta == 1)
 *   gemm_m1_lda         gemm reads A as a packed row when m == 1 (a padded lda misread)
 *   gemm_cache_b        gemm copies B once per address and layout, and reads the copy when they come again
 *                       (right for any one call; wrong for a second call on the same memory with new values)
 *   adamw_step_1000     adamw_update drops the bias correction past step 1000 (right for the first 1000 steps)
 *   adamw_betas         adamw_update uses PyTorch's default betas (0.9, 0.999) whatever the attributes say
 *   rope_long           rope keeps the position in 16 bits: wrong for positions past 65535 (long contexts)
 *   mul_tail_read       mul reads one element past the end of a, times zero (a vector tail's masked-off lane):
 *                       right whatever lies there, but NaN or inf
 *   softmax_order       softmax sums each row in f32, in an order that changes from call to call (as atomics do):
 *                       within every tolerance, but the same call twice gives other bits
 *   layer_norm_one_pass layer_norm takes the variance in one f32 pass as E[x^2] - mean^2: right for rows centred
 *                       near 0, lost to cancellation in rows whose mean is large beside their spread
 *
 * Each plant is marked "PLANT" below. Plain C99, built only against the ABI header (like plugins/cpu_sample). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loom_kernel_abi.h"

#if defined(__GNUC__)
#define PLANTED_THREAD_LOCAL __thread
#else
#define PLANTED_THREAD_LOCAL
#endif

enum {
  PLANT_NONE,
  PLANT_GEMM_RESIDUE,
  PLANT_GEMM_BETA,
  PLANT_GEMM_TRANS,
  PLANT_ADD_BF16,
  PLANT_ADD_STRIDED,
  PLANT_MUL_OOB,
  PLANT_RELU_INPUT,
  PLANT_SOFTMAX_LONG,
  PLANT_LAYER_NORM_RESIDUE,
  PLANT_ADD_NAN,
  PLANT_ADD_ALIAS,
  PLANT_SOFTMAX_OVERFLOW,
  PLANT_SOFTMAX_MASKED,
  PLANT_GEMM_ALIGN,
  PLANT_GEMM_STRIDE0,
  PLANT_GEMM_BIAS_LONG,
  PLANT_GEMM_ALPHA0,
  PLANT_GEMM_M1_LDA,
  PLANT_GEMM_CACHE_B,
  PLANT_ADAMW_STEP_1000,
  PLANT_ADAMW_BETAS,
  PLANT_ROPE_LONG,
  PLANT_MUL_TAIL_READ,
  PLANT_SOFTMAX_ORDER,
  PLANT_LAYER_NORM_ONE_PASS
};
/* The LOOM_PLANTED values, in the order of the enum. */
static const char* const plant_names[] = {"none",        "gemm_residue", "gemm_beta",  "gemm_trans",
                                          "add_bf16",    "add_strided",  "mul_oob",    "relu_input",
                                          "softmax_long", "layer_norm_residue", "add_nan",    "add_alias",
                                          "softmax_overflow", "softmax_masked", "gemm_align", "gemm_stride0",
                                          "gemm_bias_long", "gemm_alpha0",  "gemm_m1_lda", "gemm_cache_b",
                                          "adamw_step_1000", "adamw_betas", "rope_long", "mul_tail_read", "softmax_order",
                                          "layer_norm_one_pass"};
#define N_PLANTS ((int)(sizeof plant_names / sizeof plant_names[0]))
static int plant = PLANT_NONE;

static PLANTED_THREAD_LOCAL char error_message[512];
static const char* planted_last_error(void* ctx) {
  (void)ctx;
  return error_message;
}
static int fail(int status, const char* message) {
  snprintf(error_message, sizeof error_message, "planted: %s", message);
  return status;
}

/* ---- Elements: f32 or bf16, read as double, written with round-to-nearest-even. ---- */

static float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
  u += 0x7fffu + ((u >> 16) & 1u);                                            /* round to nearest, ties to even */
  return (uint16_t)(u >> 16);
}
static int is_float_dtype(int32_t dtype) { return dtype == LOOM_DTYPE_F32 || dtype == LOOM_DTYPE_BF16; }

static double get(const LoomTensorDesc* t, int64_t offset) {
  if (t->dtype == LOOM_DTYPE_BF16) return bf16_to_float(((const uint16_t*)t->data)[offset]);
  return ((const float*)t->data)[offset];
}
static void set(const LoomTensorDesc* t, int64_t offset, double v) {
  if (t->dtype == LOOM_DTYPE_BF16)
    ((uint16_t*)t->data)[offset] = float_to_bf16((float)v);
  else
    ((float*)t->data)[offset] = (float)v;
}

/* The offset of the i-th element (row-major over `shape`) in a tensor with `strides`. */
static int64_t offset_of(int rank, const int64_t* shape, const int64_t* strides, int64_t i) {
  int64_t offset = 0;
  for (int d = rank - 1; d >= 0; --d) {
    offset += (i % shape[d]) * strides[d];
    i /= shape[d];
  }
  return offset;
}
static int same_shape(const LoomTensorDesc* a, const LoomTensorDesc* b) {
  if (a->rank != b->rank) return 0;
  for (int d = 0; d < a->rank; ++d)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* ---- gemm: C = alpha * op(A) * op(B) + beta * C, column-major, strided batch, accumulated in double. ---- */

static int gemm_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                         const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  const int64_t epilogue = loom_attr_int(attrs, n_attrs, "epilogue", 0);
  if (n_in < 2 || n_out < 1 || (epilogue != 0 && epilogue != 1)) return 0;
  /* epilogue 1 (bias): bias has m entries of the output dtype. */
  if (epilogue == 1 && (n_in < 3 || !in[2].data || in[2].dtype != out[0].dtype)) return 0;
  return in[0].dtype == in[1].dtype && is_float_dtype(in[0].dtype) && is_float_dtype(out[0].dtype);
}

/* The gemm_cache_b plant's cache: a copy of B's memory, keyed by its address and layout, not by its contents. */
static struct {
  const void* data;
  int64_t k, n, ldb, batch, stride, dtype, trans;
  void* copy;
  LoomTensorDesc desc;
} b_cache;

static int planted_gemm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                        const LoomAttr* attrs, int n_attrs) {
  if (!gemm_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "gemm: only epilogues 0 and 1 on f32/bf16");
  const int ta = (int)loom_attr_int(attrs, n_attrs, "trans_a", 0), tb = (int)loom_attr_int(attrs, n_attrs, "trans_b", 0);
  const int64_t m = loom_attr_int(attrs, n_attrs, "m", 0), n = loom_attr_int(attrs, n_attrs, "n", 0);
  const int64_t k = loom_attr_int(attrs, n_attrs, "k", 0), batch = loom_attr_int(attrs, n_attrs, "batch", 1);
  const int64_t lda = loom_attr_int(attrs, n_attrs, "lda", 0), ldb = loom_attr_int(attrs, n_attrs, "ldb", 0);
  const int64_t ldc = loom_attr_int(attrs, n_attrs, "ldc", 0);
  int64_t sa = loom_attr_int(attrs, n_attrs, "stride_a", 0), sb = loom_attr_int(attrs, n_attrs, "stride_b", 0);
  const int64_t sc = loom_attr_int(attrs, n_attrs, "stride_c", 0);
  const double alpha = loom_attr_float(attrs, n_attrs, "alpha", 1), beta = loom_attr_float(attrs, n_attrs, "beta", 0);
  int add_bias = loom_attr_int(attrs, n_attrs, "epilogue", 0) == 1, add_c = beta != 0;
  int64_t a_col_step = lda; /* A's step between columns when not transposed */
  LoomTensorDesc a_desc = in[0];
  const LoomTensorDesc *A = &a_desc, *B = &in[1], *bias = &in[2], *C = &out[0];
  /* PLANT gemm_alpha0: a quick return for alpha == 0 that leaves C as it is (BLAS's rule is C = beta * C). */
  if (plant == PLANT_GEMM_ALPHA0 && alpha == 0) return LOOM_STATUS_OK;
  /* PLANT gemm_align: A is read from its pointer rounded down to 16 bytes (a vector load that assumes aligned
   * matrices): wrong when A starts at an element offset that is not a multiple of 16 bytes. */
  if (plant == PLANT_GEMM_ALIGN) a_desc.data = (void*)((uintptr_t)a_desc.data & ~(uintptr_t)15);
  /* PLANT gemm_bias_long: the split-k path taken for k > 256 forgets the bias epilogue. */
  if (plant == PLANT_GEMM_BIAS_LONG && k > 256) add_bias = 0;
  /* PLANT gemm_stride0: the product of batch 0 is reused for every batch when A's OR B's batch stride is 0 (a
   * broadcast operand); that is right only when both are. */
  if (plant == PLANT_GEMM_STRIDE0 && (sa == 0 || sb == 0)) sa = sb = 0;
  /* PLANT gemm_m1_lda: for m == 1 (a matrix-vector product) A's one row is read as packed, ignoring lda. */
  if (plant == PLANT_GEMM_M1_LDA && m == 1 && !ta) a_col_step = 1;
  /* PLANT gemm_beta: C's old value is dropped (the beta == 0 path is taken for every beta). */
  if (plant == PLANT_GEMM_BETA) add_c = 0;
  /* PLANT gemm_cache_b: B is copied (packed, in a real library) on first use of its address and layout, and the copy
   * is read whenever they come again: stale when the same memory holds new values. */
  if (plant == PLANT_GEMM_CACHE_B) {
    const int64_t matrices = sb == 0 ? 1 : batch, bytes = B->dtype == LOOM_DTYPE_BF16 ? 2 : 4;
    const int64_t span = k > 0 && n > 0 && matrices > 0
                             ? (matrices - 1) * sb + (tb ? n - 1 + (k - 1) * ldb : k - 1 + (n - 1) * ldb) + 1
                             : 0;
    if (!b_cache.copy || b_cache.data != B->data || b_cache.k != k || b_cache.n != n || b_cache.ldb != ldb ||
        b_cache.batch != batch || b_cache.stride != sb || b_cache.dtype != B->dtype || b_cache.trans != tb) {
      void* copy = malloc((size_t)(span * bytes) + 1);
      if (!copy) return fail(LOOM_STATUS_OUT_OF_MEMORY, "gemm: no memory for the copy of B");
      if (span > 0) memcpy(copy, B->data, (size_t)(span * bytes));
      free(b_cache.copy);
      b_cache.data = B->data, b_cache.k = k, b_cache.n = n, b_cache.ldb = ldb, b_cache.batch = batch;
      b_cache.stride = sb, b_cache.dtype = B->dtype, b_cache.trans = tb, b_cache.copy = copy;
    }
    b_cache.desc = *B;
    b_cache.desc.data = b_cache.copy;
    B = &b_cache.desc;
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        int64_t k_end = k;
        /* PLANT gemm_residue: rows are done in blocks of 7, and the remainder block of 3 rows (m % 7 == 3) stops
         * one k step early: the last k term is dropped for those rows. */
        if (plant == PLANT_GEMM_RESIDUE && m % 7 == 3 && i >= m - 3 && k_end > 0) k_end = k - 1;
        double acc = 0;
        for (int64_t p = 0; p < k_end; ++p) {
          const double a = get(A, b * sa + (ta ? p + i * lda : i + p * a_col_step));
          int64_t b_offset = b * sb + (tb ? j + p * ldb : p + j * ldb);
          /* PLANT gemm_trans: with trans_b, the k = 1 step reads B one element early (an off-by-one). */
          if (plant == PLANT_GEMM_TRANS && tb && p == 1) b_offset -= 1;
          acc += a * get(B, b_offset);
        }
        const int64_t c_offset = b * sc + i + j * ldc;
        double v = alpha * acc;
        if (add_c) v += beta * get(C, c_offset);
        if (add_bias) v += get(bias, i);
        set(C, c_offset, v);
      }
  return LOOM_STATUS_OK;
}

/* ---- Elementwise: every tensor has out's shape, any strides (stride 0 for a broadcast input). ---- */

static int elementwise_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                                const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_out != 1 || !is_float_dtype(out[0].dtype)) return 0;
  for (int i = 0; i < n_in; ++i)
    if (in[i].dtype != out[0].dtype || !same_shape(&in[i], &out[0])) return 0;
  return 1;
}

/* The strides b would have if its non-broadcast dims were packed (row-major), 0 for the broadcast ones. */
static void packed_strides(const LoomTensorDesc* t, int64_t* strides) {
  int64_t run = 1;
  for (int d = t->rank - 1; d >= 0; --d) {
    strides[d] = t->strides[d] == 0 ? 0 : run;
    if (t->strides[d] != 0) run *= t->shape[d];
  }
}

enum { OP_ADD, OP_MUL };

static int binary(int op, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out) {
  if (n_in != 2 || n_out != 1 || !elementwise_supports(NULL, in, n_in, out, n_out, NULL, 0))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "add/mul: expected a, b and out of one shape and dtype (f32/bf16)");
  const LoomTensorDesc *a = &in[0], *b = &in[1], *o = &out[0];
  const int rank = o->rank;
  int64_t b_strides[LOOM_MAX_DIMS];
  memcpy(b_strides, b->strides, sizeof b_strides);
  /* PLANT add_strided: b is read as if its (non-broadcast) dims were packed: wrong for a strided or transposed b. */
  if (op == OP_ADD && plant == PLANT_ADD_STRIDED) packed_strides(b, b_strides);
  const int64_t numel = loom_desc_numel(o);
  for (int64_t i = 0; i < numel; ++i) {
    double x = get(a, offset_of(rank, o->shape, a->strides, i));
    const int64_t at = offset_of(rank, o->shape, o->strides, i);
    if (op == OP_ADD && plant == PLANT_ADD_ALIAS) {
      /* PLANT add_alias: out = a is stored first and b added to it afterwards (exact, as a and out share a
       * dtype), so b is read after out is written: when out is b's memory, b's element is gone (a + a). */
      set(o, at, x);
      set(o, at, get(o, at) + get(b, offset_of(rank, o->shape, b_strides, i)));
      continue;
    }
    double y = get(b, offset_of(rank, o->shape, b_strides, i));
    /* PLANT add_nan: a NaN input counts as 0 (a masked-load idiom that zero-fills what fails x == x). */
    if (op == OP_ADD && plant == PLANT_ADD_NAN) {
      if (x != x) x = 0;
      if (y != y) y = 0;
    }
    const double v = op == OP_ADD ? x + y : x * y;
    set(o, at, v);
    if (op == OP_ADD && plant == PLANT_ADD_BF16 && o->dtype == LOOM_DTYPE_BF16) {
      /* PLANT add_bf16: the bf16 sum is truncated (rounded toward zero) instead of rounded to nearest even. */
      float f = (float)v;
      uint32_t u;
      memcpy(&u, &f, sizeof u);
      ((uint16_t*)o->data)[at] = (uint16_t)(u >> 16);
    }
  }
  if (op == OP_MUL && plant == PLANT_MUL_TAIL_READ && numel > 0) {
    /* PLANT mul_tail_read: the last element adds 0 times the element just past a's end, as a vectorized tail whose
     * masked-off lane was loaded anyway: the product is unchanged unless that memory holds NaN or inf. */
    int64_t a_end = 1;
    for (int d = 0; d < rank; ++d) a_end += (o->shape[d] - 1) * a->strides[d];
    const int64_t last = offset_of(rank, o->shape, o->strides, numel - 1);
    set(o, last, get(o, last) + 0.0 * get(a, a_end));
  }
  if (op == OP_MUL && plant == PLANT_MUL_OOB && numel > 0) {
    /* PLANT mul_oob: the element just past the end of out is written (its bits flipped, so any guard value
     * changes). */
    int64_t end = 1;
    for (int d = 0; d < rank; ++d) end += (o->shape[d] - 1) * o->strides[d];
    if (o->dtype == LOOM_DTYPE_BF16) {
      uint16_t* p = (uint16_t*)o->data + end;
      *p = (uint16_t)~*p;
    } else {
      uint32_t* p = (uint32_t*)o->data + end;
      *p = ~*p;
    }
  }
  return LOOM_STATUS_OK;
}

static int planted_add(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                       const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  return binary(OP_ADD, in, n_in, out, n_out);
}
static int planted_mul(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                       const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  return binary(OP_MUL, in, n_in, out, n_out);
}

static int planted_relu(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                        const LoomAttr* attrs, int n_attrs) {
  if (n_in != 1 || n_out != 1 || !elementwise_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "relu: expected x and out of one shape and dtype (f32/bf16)");
  const LoomTensorDesc *x = &in[0], *o = &out[0];
  for (int64_t i = 0, numel = loom_desc_numel(o); i < numel; ++i) {
    const int64_t from = offset_of(o->rank, o->shape, x->strides, i);
    const double v = get(x, from);
    const double r = v < 0 ? 0.0 : v; /* NaN stays NaN, as Loom's relu */
    /* PLANT relu_input: x is clamped in place and then copied to out (the result is right, the input is not). */
    if (plant == PLANT_RELU_INPUT) set(x, from, r);
    set(o, offset_of(o->rank, o->shape, o->strides, i), r);
  }
  return LOOM_STATUS_OK;
}

/* ---- softmax over the last dim of a contiguous tensor, in double. ---- */

static int64_t normalized_dim(int64_t dim, int rank) { return dim < 0 ? dim + rank : dim; }

static int softmax_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                            const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  if (n_in != 1 || n_out != 1 || in[0].rank < 1 || in[0].dtype != out[0].dtype || !same_shape(&in[0], &out[0]))
    return 0;
  return normalized_dim(loom_attr_int(attrs, n_attrs, "dim", -1), in[0].rank) == in[0].rank - 1 &&
         loom_desc_is_contiguous(&in[0]) && loom_desc_is_contiguous(&out[0]);
}

static int planted_softmax(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                           const LoomAttr* attrs, int n_attrs) {
  if (!softmax_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "softmax: only the last dim of contiguous f32/bf16 tensors");
  const LoomTensorDesc *x = &in[0], *o = &out[0];
  const int64_t cols = x->shape[x->rank - 1];
  if (cols == 0) return LOOM_STATUS_OK;
  const int64_t rows = loom_desc_numel(x) / cols;
  /* PLANT softmax_long: the normalizing sum covers only the first 4096 elements of a row (a fixed-size block
   * reduction that forgets the tail): longer rows come out too large, but finite. */
  int64_t sum_end = cols;
  if (plant == PLANT_SOFTMAX_LONG && cols > 4096) sum_end = 4096;
  static unsigned softmax_calls = 0;  /* for softmax_order: one order per call */
  ++softmax_calls;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    double max = -INFINITY, sum = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double v = get(x, base + c);
      if (v > max) max = v;
    }
    if (plant == PLANT_SOFTMAX_OVERFLOW) {
      /* PLANT softmax_overflow: exp(x) in f32 without subtracting the row's max: fine for small logits, but
       * expf(100) overflows to inf and the row becomes inf / inf = NaN. */
      for (int64_t c = 0; c < cols; ++c) sum += expf((float)get(x, base + c));
      for (int64_t c = 0; c < cols; ++c) set(o, base + c, expf((float)get(x, base + c)) / sum);
      continue;
    }
    if (plant == PLANT_SOFTMAX_MASKED && max == -INFINITY) {
      /* PLANT softmax_masked: a fully masked row (every logit -inf) is written as zeros; the op's result there is
       * NaN (0 / 0, as PyTorch and Loom's native kernel give). */
      for (int64_t c = 0; c < cols; ++c) set(o, base + c, 0.0);
      continue;
    }
    if (plant == PLANT_SOFTMAX_ORDER) {
      /* PLANT softmax_order: the row's sum in f32, starting at a column that moves with every call (the order in
       * which atomics from many threads land): each result is within tolerance, their bits differ. */
      const int64_t start = (int64_t)(softmax_calls % (unsigned)cols);
      float fsum = 0;
      for (int64_t k = 0; k < cols; ++k) fsum += (float)exp(get(x, base + (start + k) % cols) - max);
      for (int64_t c = 0; c < cols; ++c) set(o, base + c, (float)exp(get(x, base + c) - max) / fsum);
      continue;
    }
    for (int64_t c = 0; c < sum_end; ++c) sum += exp(get(x, base + c) - max);
    for (int64_t c = 0; c < cols; ++c) set(o, base + c, exp(get(x, base + c) - max) / sum);
  }
  return LOOM_STATUS_OK;
}

/* ---- layer_norm over the last dim (contiguous): out = (x - mean) * rstd * weight + bias; mean, rstd in f32. ---- */

static int layer_norm_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out,
                               int n_out, const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 3 || n_out != 3 || in[0].rank < 1 || !loom_desc_is_contiguous(&in[0])) return 0;
  if (out[0].dtype != in[0].dtype || !same_shape(&in[0], &out[0]) || !loom_desc_is_contiguous(&out[0])) return 0;
  for (int i = 1; i < 3; ++i) /* weight, bias: absent, or [C] in x's dtype */
    if (in[i].data && (in[i].dtype != in[0].dtype || loom_desc_numel(&in[i]) != in[0].shape[in[0].rank - 1]))
      return 0;
  for (int i = 1; i < 3; ++i) /* mean, rstd: f32 */
    if (out[i].dtype != LOOM_DTYPE_F32 || !loom_desc_is_contiguous(&out[i])) return 0;
  return 1;
}

static int planted_layer_norm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                              const LoomAttr* attrs, int n_attrs) {
  if (!layer_norm_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "layer_norm: expected contiguous f32/bf16 x, f32 mean and rstd");
  const LoomTensorDesc *x = &in[0], *w = &in[1], *bias = &in[2], *o = &out[0];
  const double eps = loom_attr_float(attrs, n_attrs, "eps", 1e-5);
  const int64_t cols = x->shape[x->rank - 1];
  if (cols == 0) return LOOM_STATUS_OK;
  const int64_t rows = loom_desc_numel(x) / cols;
  /* PLANT layer_norm_residue: when C % 8 == 5 the variance is divided by C - 1 (the unbiased estimate). */
  double divisor = (double)cols;
  if (plant == PLANT_LAYER_NORM_RESIDUE && cols % 8 == 5) divisor = (double)(cols - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += get(x, base + c);
    mean /= (double)cols;
    for (int64_t c = 0; c < cols; ++c) {
      const double d = get(x, base + c) - mean;
      var += d * d;
    }
    if (plant == PLANT_LAYER_NORM_ONE_PASS) { /* PLANT layer_norm_one_pass: sum and sum of squares in f32 */
      float s = 0, s2 = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = (float)get(x, base + c);
        s += v;
        s2 += v * v;
      }
      const float m = s / (float)cols, v = s2 / (float)cols - m * m;
      var = (v > 0 ? v : 0) * divisor;
    }
    const double rstd = 1.0 / sqrt(var / divisor + eps);
    for (int64_t c = 0; c < cols; ++c) {
      double v = (get(x, base + c) - mean) * rstd;
      if (w->data) v *= get(w, c);
      if (bias->data) v += get(bias, c);
      set(o, base + c, v);
    }
    set(&out[1], r, mean);
    set(&out[2], r, rstd);
  }
  return LOOM_STATUS_OK;
}

/* ---- rope (contiguous) and rope_strided (unit stride along D): x, out [B, H, T, D]; cos, sin [T, D/2] f32. ---- */

static int rope_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                         const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 3 || n_out != 1 || in[0].rank != 4 || !same_shape(&in[0], &out[0])) return 0;
  if (!is_float_dtype(in[0].dtype) || out[0].dtype != in[0].dtype) return 0;
  if (in[0].shape[3] > 1 && (in[0].strides[3] != 1 || out[0].strides[3] != 1)) return 0;
  for (int i = 1; i < 3; ++i)
    if (in[i].dtype != LOOM_DTYPE_F32 || !loom_desc_is_contiguous(&in[i])) return 0;
  return 1;
}

static int planted_rope(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                        const LoomAttr* attrs, int n_attrs) {
  if (!rope_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT,
                "rope: expected x and out [B, H, T, D] (unit stride along D), f32 cos and sin");
  const LoomTensorDesc *x = &in[0], *o = &out[0];
  const float *cs = (const float*)in[1].data, *sn = (const float*)in[2].data;
  const int64_t half = x->shape[3] / 2;
  const double sign = loom_attr_int(attrs, n_attrs, "inverse", 0) ? -1.0 : 1.0;
  for (int64_t b = 0; b < x->shape[0]; ++b)
    for (int64_t h = 0; h < x->shape[1]; ++h)
      for (int64_t t = 0; t < x->shape[2]; ++t) {
        const int64_t xr = b * x->strides[0] + h * x->strides[1] + t * x->strides[2];
        const int64_t orow = b * o->strides[0] + h * o->strides[1] + t * o->strides[2];
        int64_t pos = t;
        /* PLANT rope_long: the position is kept in 16 bits (a packed position id): past 65535 it wraps, and the
         * row of the cos/sin tables read is that of position t - 65536. */
        if (plant == PLANT_ROPE_LONG) pos = (int64_t)(uint16_t)t;
        for (int64_t i = 0; i < half; ++i) {
          const double first = get(x, xr + i), second = get(x, xr + i + half);
          const double c = cs[pos * half + i], s = sign * sn[pos * half + i];
          set(o, orow + i, first * c - second * s);
          set(o, orow + i + half, second * c + first * s);
        }
      }
  return LOOM_STATUS_OK;
}

/* ---- adamw_update: param (f32/bf16) and its f32 states in place, grad f32/bf16, all contiguous, as PyTorch's. ---- */

static int adamw_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                          const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)attrs;
  (void)n_attrs;
  if (n_in != 1 || n_out != 3 || !is_float_dtype(out[0].dtype) || !is_float_dtype(in[0].dtype)) return 0;
  if (!loom_desc_is_contiguous(&in[0]) || loom_desc_numel(&in[0]) != loom_desc_numel(&out[0])) return 0;
  for (int i = 0; i < 3; ++i)
    if (!loom_desc_is_contiguous(&out[i]) || loom_desc_numel(&out[i]) != loom_desc_numel(&out[0])) return 0;
  return out[1].dtype == LOOM_DTYPE_F32 && out[2].dtype == LOOM_DTYPE_F32;
}

static int planted_adamw_update(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                                const LoomAttr* attrs, int n_attrs) {
  if (!adamw_supports(ctx, in, n_in, out, n_out, attrs, n_attrs))
    return fail(LOOM_STATUS_INVALID_ARGUMENT, "adamw_update: expected grad; param, f32 exp_avg and exp_avg_sq");
  const LoomTensorDesc *g = &in[0], *p = &out[0], *m = &out[1], *v = &out[2];
  const double lr = loom_attr_float(attrs, n_attrs, "lr", 1e-3);
  const double wd = loom_attr_float(attrs, n_attrs, "weight_decay", 0);
  double beta1 = loom_attr_float(attrs, n_attrs, "beta1", 0.9), beta2 = loom_attr_float(attrs, n_attrs, "beta2", 0.999);
  const double eps = loom_attr_float(attrs, n_attrs, "eps", 1e-8);
  const int64_t step = loom_attr_int(attrs, n_attrs, "step", 1);
  /* PLANT adamw_betas: the betas are PyTorch's defaults, not the attributes (a kernel written for one recipe). */
  if (plant == PLANT_ADAMW_BETAS) beta1 = 0.9, beta2 = 0.999;
  double bc1 = 1 - pow(beta1, (double)step), bc2 = 1 - pow(beta2, (double)step);
  /* PLANT adamw_step_1000: the bias corrections are taken as converged (1) past step 1000; with beta2 = 0.999 they
   * are not (1 - 0.999^1001 = 0.63): right for the first 1000 steps of a run only. */
  if (plant == PLANT_ADAMW_STEP_1000 && step > 1000) bc1 = bc2 = 1;
  for (int64_t i = 0, n = loom_desc_numel(p); i < n; ++i) {
    const double gi = get(g, i);
    const double mi = beta1 * get(m, i) + (1 - beta1) * gi, vi = beta2 * get(v, i) + (1 - beta2) * gi * gi;
    const double pi = get(p, i) * (1 - lr * wd);
    set(p, i, pi - lr / bc1 * mi / (sqrt(vi) / sqrt(bc2) + eps));
    set(m, i, mi);
    set(v, i, vi);
  }
  return LOOM_STATUS_OK;
}

#define F32_BF16 (LOOM_DTYPE_BIT(LOOM_DTYPE_F32) | LOOM_DTYPE_BIT(LOOM_DTYPE_BF16))
static const LoomOpEntry planted_ops[] = {
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "gemm", F32_BF16, 0, planted_gemm, gemm_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "add", F32_BF16, 0, planted_add, elementwise_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "mul", F32_BF16, 0, planted_mul, elementwise_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "relu", F32_BF16, 0, planted_relu, elementwise_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "softmax", F32_BF16, 0, planted_softmax, softmax_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "layer_norm", F32_BF16, 0, planted_layer_norm, layer_norm_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "rope", F32_BF16, 0, planted_rope, rope_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "rope_strided", F32_BF16, 0, planted_rope, rope_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "adamw_update", F32_BF16, 0, planted_adamw_update, adamw_supports, {0}},
};

LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* host, LoomProvider* p) {
  p->abi_major = LOOM_ABI_VERSION_MAJOR;
  p->abi_minor = LOOM_ABI_VERSION_MINOR;
  p->last_error = planted_last_error;
  if (host->abi_major != LOOM_ABI_VERSION_MAJOR) return fail(LOOM_STATUS_UNSUPPORTED, "host ABI does not match");
  const char* which = getenv("LOOM_PLANTED");
  plant = -1;
  if (!which || !*which) which = "none";
  for (int i = 0; i < N_PLANTS; ++i)
    if (strcmp(which, plant_names[i]) == 0) plant = i;
  if (plant < 0) {
    char known[600] = "";
    for (int i = 0; i < N_PLANTS; ++i) {
      if (i) strncat(known, ", ", sizeof known - strlen(known) - 1);
      strncat(known, plant_names[i], sizeof known - strlen(known) - 1);
    }
    snprintf(error_message, sizeof error_message, "planted: unknown LOOM_PLANTED '%.64s' (%s)", which, known);
    return LOOM_STATUS_UNSUPPORTED;
  }
  p->name = "planted";
  p->version = plant_names[plant];
  p->ctx = NULL;
  p->ops = planted_ops;
  p->n_ops = (int32_t)(sizeof planted_ops / sizeof planted_ops[0]);
  return LOOM_STATUS_OK;
}
