// CPU FP8 kernels: the reference implementation of the contracts in src/kernels/fp8_kernel.h (what CI checks and
// what an FP8 training step runs on a machine without FP8 hardware: slow, exact to the contract).
#include <cblas.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/elementwise_cpu_common.h"
#include "kernels/fp8_kernel.h"

namespace loom {
namespace {

// NaN wins, then the larger: a max that keeps a NaN once it has met one, in any order.
inline float max_keeping_nan(float m, float v) { return (std::isnan(v) || v > m) ? v : m; }

// The amax of n values made here, value(i) as its op stores it, in chunks (order-independent, so any
// split gives the same value; 0 for n = 0).
template <typename Value>
float amax_made(int64_t n, const Value& value) {
  constexpr int64_t kChunk = 1 << 16;
  std::vector<float> partial(size_t((n + kChunk - 1) / kChunk), 0.0f);
  cpu::parallel_for(int64_t(partial.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t chunk = b; chunk < e; ++chunk) {
      float m = 0;
      for (int64_t i = chunk * kChunk, end = std::min(n, i + kChunk); i < end; ++i)
        m = max_keeping_nan(m, std::fabs(value(i)));
      partial[size_t(chunk)] = m;
    }
  });
  float m = 0;
  for (float p : partial) m = max_keeping_nan(m, p);
  return m;
}

// max |x[i]| over [0, n) of an f32 or bf16 array.
template <typename T>
float amax_of(const T* x, int64_t n) {
  return amax_made(n, [&](int64_t i) { return float(x[i]); });
}

#define LOOM_DISPATCH_UNQUANTIZED(DT, OPNAME, ...)                                                             \
  [&] {                                                                                                        \
    switch (DT) {                                                                                              \
      case DType::kF32: { using high_t = float; return __VA_ARGS__(); }                                         \
      case DType::kBF16: { using high_t = BFloat16; return __VA_ARGS__(); }                                     \
      default: LOOM_THROW(OPNAME, ": dtype ", dtype_name(DT), " is not f32 or bf16");                          \
    }                                                                                                          \
  }()

void fp8_amax_cpu(const DeviceContext&, const Tensor& x, Tensor& amax) {
  LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "fp8_amax", [&] {
    *static_cast<float*>(amax.data()) = amax_of(static_cast<const high_t*>(x.data()), x.numel());
  });
}

void fp8_scale_cpu(const DeviceContext&, const Tensor& amax_in, const Fp8ScaleAttrs& attrs, Tensor& history,
                   Tensor& scale, Tensor& scale_inv) {
  float* h = static_cast<float*>(history.data());
  const int64_t n = history.numel();
  for (int64_t i = n - 1; i > 0; --i) h[i] = h[i - 1];
  if (n > 0) h[0] = *static_cast<const float*>(amax_in.data());
  float a = NAN;
  for (int64_t i = 0; i < n; ++i) a = std::isnan(a) || h[i] > a ? h[i] : a;  // NaN elements skipped
  float& s = *static_cast<float*>(scale.data());
  if (std::isfinite(a) && a > 0) {
    const float next = std::ldexp(float(attrs.fp8_max) / a, -int(attrs.margin));
    if (std::isfinite(next) && next > 0) s = next;
  }
  *static_cast<float*>(scale_inv.data()) = 1.0f / s;
}

void fp8_quantize_cpu(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax) {
  const float s = *static_cast<const float*>(scale.data());
  const int64_t n = x.numel();
  LOOM_DISPATCH_FP8(q.dtype(), "fp8_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "fp8_quantize", [&] {
      const high_t* in = static_cast<const high_t*>(x.data());
      uint8_t* out = static_cast<uint8_t*>(q.data());
      cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) out[i] = fp8_encode<fp8_t>(float(in[i]) * s, Fp8Overflow::kSaturate);
      });
      if (amax.defined()) *static_cast<float*>(amax.data()) = amax_of(in, n);
    });
  });
}

// fp8_quantize_transposed's codes of the values value(i) (each as its op stores it), their amax and, where
// column_sums is defined, their column sums in f32 over blocks of 64 rows (each block's sum in row order, then the
// blocks' in order, as the CUDA kernel takes them).
template <typename fp8_t, typename Value>
void quantize_transposed_summing(const Value& value, int64_t R, int64_t C, float s, Tensor& q, Tensor& qt,
                                 Tensor& amax, Tensor& column_sums) {
  constexpr int64_t kBlockRows = 64;
  const int64_t blocks = (R + kBlockRows - 1) / kBlockRows;
  const bool summing = column_sums.defined();
  std::vector<float> partial(summing ? size_t(blocks * C) : 0, 0.0f), block_amax(size_t(blocks), 0.0f);
  uint8_t* out = static_cast<uint8_t*>(q.data());
  uint8_t* out_t = static_cast<uint8_t*>(qt.data());
  cpu::parallel_for(blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t block = b; block < e; ++block) {
      float* sums = summing ? partial.data() + block * C : nullptr;
      float m = 0;
      for (int64_t r = block * kBlockRows; r < std::min(R, (block + 1) * kBlockRows); ++r)
        for (int64_t c = 0; c < C; ++c) {
          const float v = value(r * C + c);
          const uint8_t code = fp8_encode<fp8_t>(v * s, Fp8Overflow::kSaturate);
          out[r * C + c] = code;
          out_t[c * R + r] = code;
          if (summing) sums[c] += v;
          m = max_keeping_nan(m, std::fabs(v));
        }
      block_amax[size_t(block)] = m;
    }
  });
  if (amax.defined()) {
    float m = 0;
    for (float a : block_amax) m = max_keeping_nan(m, a);
    *static_cast<float*>(amax.data()) = m;
  }
  if (summing) {
    float* sums_out = static_cast<float*>(column_sums.data());
    for (int64_t c = 0; c < C; ++c) {
      float sum = 0;
      for (int64_t block = 0; block < blocks; ++block) sum += partial[size_t(block * C + c)];
      sums_out[c] = sum;
    }
  }
}

// x's codes in both layouts, their amax and, where column_sums is defined, x's column sums: fp8_quantize_transposed
// and fp8_quantize_transposed_sums.
void quantize_transposed_cpu(const char* op, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& qt, Tensor& amax,
                             Tensor& column_sums) {
  const float s = *static_cast<const float*>(scale.data());
  LOOM_DISPATCH_FP8(q.dtype(), op, [&] {
    LOOM_DISPATCH_UNQUANTIZED(x.dtype(), op, [&] {
      const high_t* in = static_cast<const high_t*>(x.data());
      quantize_transposed_summing<fp8_t>([&](int64_t i) { return float(in[i]); }, x.size(0), x.size(1), s, q, qt,
                                         amax, column_sums);
    });
  });
}

void fp8_quantize_transposed_cpu(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& qt,
                                 Tensor& amax) {
  Tensor no_sums;
  quantize_transposed_cpu("fp8_quantize_transposed", x, scale, q, qt, amax, no_sums);
}

void fp8_quantize_transposed_sums_cpu(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q,
                                      Tensor& qt, Tensor& amax, Tensor& column_sums) {
  quantize_transposed_cpu("fp8_quantize_transposed_sums", x, scale, q, qt, amax, column_sums);
}

// gelu_backward's element as its kernel stores it, then fp8_quantize_transposed's codes of it and its column sums.
void gelu_backward_quantize_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, const Tensor& scale,
                                Tensor& q, Tensor& qt, Tensor& amax, Tensor& column_sums) {
  const float s = *static_cast<const float*>(scale.data());
  LOOM_DISPATCH_FP8(q.dtype(), "gelu_backward_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "gelu_backward_quantize", [&] {
      using M = cpu::math_t<high_t>;
      const high_t* g = static_cast<const high_t*>(grad.data());
      const high_t* in = static_cast<const high_t*>(x.data());
      quantize_transposed_summing<fp8_t>(
          [&](int64_t i) { return float(high_t(elementwise_math::GeluBackward{}(M(g[i]), M(in[i])))); }, x.size(0),
          x.size(1), s, q, qt, amax, column_sums);
    });
  });
}

// swiglu_backward's two elements as its kernel stores them, then fp8_quantize_transposed's codes of each with its own
// scale; each amax as amax_of takes it.
void swiglu_backward_quantize_cpu(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                  const Tensor& scale_gate, const Tensor& scale_up, Tensor& q_gate, Tensor& qt_gate,
                                  Tensor& q_up, Tensor& qt_up, Tensor& amax_gate, Tensor& amax_up) {
  const float sg = *static_cast<const float*>(scale_gate.data()), su = *static_cast<const float*>(scale_up.data());
  const int64_t R = gate.size(0), C = gate.size(1);
  std::vector<float> row_amax(size_t(2 * R), 0.0f);
  LOOM_DISPATCH_FP8(q_gate.dtype(), "swiglu_backward_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(gate.dtype(), "swiglu_backward_quantize", [&] {
      using M = cpu::math_t<high_t>;
      const high_t* g = static_cast<const high_t*>(grad.data());
      const high_t* x = static_cast<const high_t*>(gate.data());
      const high_t* u = static_cast<const high_t*>(up.data());
      uint8_t *qg = static_cast<uint8_t*>(q_gate.data()), *qgt = static_cast<uint8_t*>(qt_gate.data());
      uint8_t *qu = static_cast<uint8_t*>(q_up.data()), *qut = static_cast<uint8_t*>(qt_up.data());
      cpu::parallel_for(R, std::max<int64_t>(1, cpu::kElementwiseGrain / std::max<int64_t>(1, C)),
                        [&](int64_t b, int64_t e) {
                          for (int64_t r = b; r < e; ++r) {
                            float mg = 0, mu = 0;
                            for (int64_t c = 0; c < C; ++c) {
                              const int64_t i = r * C + c;
                              M d_gate, d_up;
                              elementwise_math::SwigluBackward{}(M(g[i]), M(x[i]), M(u[i]), d_gate, d_up);
                              const float vg = float(high_t(d_gate)), vu = float(high_t(d_up));
                              qg[i] = qgt[c * R + r] = fp8_encode<fp8_t>(vg * sg, Fp8Overflow::kSaturate);
                              qu[i] = qut[c * R + r] = fp8_encode<fp8_t>(vu * su, Fp8Overflow::kSaturate);
                              mg = max_keeping_nan(mg, std::fabs(vg));
                              mu = max_keeping_nan(mu, std::fabs(vu));
                            }
                            row_amax[size_t(2 * r)] = mg;
                            row_amax[size_t(2 * r + 1)] = mu;
                          }
                        });
    });
  });
  float mg = 0, mu = 0;
  for (int64_t r = 0; r < R; ++r) {
    mg = max_keeping_nan(mg, row_amax[size_t(2 * r)]);
    mu = max_keeping_nan(mu, row_amax[size_t(2 * r + 1)]);
  }
  if (amax_gate.defined()) *static_cast<float*>(amax_gate.data()) = mg;
  if (amax_up.defined()) *static_cast<float*>(amax_up.data()) = mu;
}

// The codes of n values made here, value(i) as its op stores it (as a float): fp8_quantize's code of each, and their
// amax in chunks as amax_of takes it (0 for n = 0).
template <typename Q, typename Value>
void quantize_made(int64_t n, float s, uint8_t* out, Tensor& amax, const Value& value) {
  constexpr int64_t kChunk = 1 << 16;
  std::vector<float> partial(size_t((n + kChunk - 1) / kChunk), 0.0f);
  cpu::parallel_for(int64_t(partial.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t chunk = b; chunk < e; ++chunk) {
      float m = 0;
      for (int64_t i = chunk * kChunk, end = std::min(n, i + kChunk); i < end; ++i) {
        const float v = value(i);
        out[i] = fp8_encode<Q>(v * s, Fp8Overflow::kSaturate);
        m = max_keeping_nan(m, std::fabs(v));
      }
      partial[size_t(chunk)] = m;
    }
  });
  if (!amax.defined()) return;
  float m = 0;
  for (float p : partial) m = max_keeping_nan(m, p);
  *static_cast<float*>(amax.data()) = m;
}

// swiglu's element as the swiglu kernel stores it, then fp8_quantize's code of it.
void swiglu_quantize_cpu(const DeviceContext&, const Tensor& gate, const Tensor& up, const Tensor& scale, Tensor& q,
                         Tensor& amax) {
  const float s = *static_cast<const float*>(scale.data());
  const int64_t C = q.size(1), n = q.numel(), lg = gate.stride(0), lu = up.stride(0);
  LOOM_DISPATCH_FP8(q.dtype(), "swiglu_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(gate.dtype(), "swiglu_quantize", [&] {
      using M = cpu::math_t<high_t>;
      const high_t* g = static_cast<const high_t*>(gate.data());
      const high_t* u = static_cast<const high_t*>(up.data());
      quantize_made<fp8_t>(n, s, static_cast<uint8_t*>(q.data()), amax, [&](int64_t i) {
        const int64_t r = i / C, c = i - r * C;
        return float(high_t(elementwise_math::Swiglu{}(M(g[r * lg + c]), M(u[r * lu + c]))));
      });
    });
  });
}

// swiglu_quantize's amax without its codes.
void swiglu_amax_cpu(const DeviceContext&, const Tensor& gate, const Tensor& up, Tensor& amax) {
  const int64_t C = gate.size(1), n = gate.numel(), lg = gate.stride(0), lu = up.stride(0);
  LOOM_DISPATCH_UNQUANTIZED(gate.dtype(), "swiglu_amax", [&] {
    using M = cpu::math_t<high_t>;
    const high_t* g = static_cast<const high_t*>(gate.data());
    const high_t* u = static_cast<const high_t*>(up.data());
    *static_cast<float*>(amax.data()) = amax_made(n, [&](int64_t i) {
      const int64_t r = i / C, c = i - r * C;
      return float(high_t(elementwise_math::Swiglu{}(M(g[r * lg + c]), M(u[r * lu + c]))));
    });
  });
}

// swiglu_backward_quantize's two amaxes without their codes.
void swiglu_backward_amax_cpu(const DeviceContext&, const Tensor& grad, const Tensor& gate, const Tensor& up,
                              Tensor& amax_gate, Tensor& amax_up) {
  const int64_t n = gate.numel();
  LOOM_DISPATCH_UNQUANTIZED(gate.dtype(), "swiglu_backward_amax", [&] {
    using M = cpu::math_t<high_t>;
    const high_t* g = static_cast<const high_t*>(grad.data());
    const high_t* x = static_cast<const high_t*>(gate.data());
    const high_t* u = static_cast<const high_t*>(up.data());
    auto gradient = [&](int64_t i, bool of_gate) {
      M d_gate, d_up;
      elementwise_math::SwigluBackward{}(M(g[i]), M(x[i]), M(u[i]), d_gate, d_up);
      return float(high_t(of_gate ? d_gate : d_up));
    };
    *static_cast<float*>(amax_gate.data()) = amax_made(n, [&](int64_t i) { return gradient(i, true); });
    *static_cast<float*>(amax_up.data()) = amax_made(n, [&](int64_t i) { return gradient(i, false); });
  });
}

// gelu_quantize's amax without its codes.
void gelu_amax_cpu(const DeviceContext&, const Tensor& x, Tensor& amax) {
  LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "gelu_amax", [&] {
    using M = cpu::math_t<high_t>;
    const high_t* in = static_cast<const high_t*>(x.data());
    *static_cast<float*>(amax.data()) =
        amax_made(x.numel(), [&](int64_t i) { return float(high_t(elementwise_math::Gelu{}(M(in[i])))); });
  });
}

// gelu_backward_quantize's amax without its codes.
void gelu_backward_amax_cpu(const DeviceContext&, const Tensor& grad, const Tensor& x, Tensor& amax) {
  LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "gelu_backward_amax", [&] {
    using M = cpu::math_t<high_t>;
    const high_t* g = static_cast<const high_t*>(grad.data());
    const high_t* in = static_cast<const high_t*>(x.data());
    *static_cast<float*>(amax.data()) = amax_made(x.numel(), [&](int64_t i) {
      return float(high_t(elementwise_math::GeluBackward{}(M(g[i]), M(in[i]))));
    });
  });
}

// gelu's element as the gelu kernel stores it, then fp8_quantize's code of it.
void gelu_quantize_cpu(const DeviceContext&, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& amax) {
  const float s = *static_cast<const float*>(scale.data());
  LOOM_DISPATCH_FP8(q.dtype(), "gelu_quantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(x.dtype(), "gelu_quantize", [&] {
      using M = cpu::math_t<high_t>;
      const high_t* in = static_cast<const high_t*>(x.data());
      quantize_made<fp8_t>(x.numel(), s, static_cast<uint8_t*>(q.data()), amax,
                           [&](int64_t i) { return float(high_t(elementwise_math::Gelu{}(M(in[i])))); });
    });
  });
}

void fp8_dequantize_cpu(const DeviceContext&, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  const float s = *static_cast<const float*>(scale_inv.data());
  const int64_t n = q.numel();
  LOOM_DISPATCH_FP8(q.dtype(), "fp8_dequantize", [&] {
    LOOM_DISPATCH_UNQUANTIZED(out.dtype(), "fp8_dequantize", [&] {
      const uint8_t* in = static_cast<const uint8_t*>(q.data());
      high_t* o = static_cast<high_t*>(out.data());
      cpu::parallel_for(n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[i] = high_t(fp8_decode<fp8_t>(in[i]) * s);
      });
    });
  });
}

// A column-major matrix of 8-bit codes (rows x cols, leading dimension ld) decoded into a dense f32 one with the
// same leading dimension: every code is exactly a float.
std::vector<float> decoded(DType dtype, const void* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(rows && cols ? size_t(ld * (cols - 1) + rows) : 0);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  LOOM_DISPATCH_FP8(dtype, "fp8_gemm", [&] {
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < rows; ++i) out[size_t(j * ld + i)] = fp8_decode<fp8_t>(s[j * ld + i]);
  });
  return out;
}

// The products of decoded codes are exact in f32 (4 significant bits times 4), summed by sgemm in f32; the scales,
// alpha, beta * C and the bias are applied in double, and the result rounded once to C's dtype.
void fp8_gemm_cpu(const DeviceContext&, const Fp8GemmParams& f) {
  const GemmParams& p = f.gemm;
  if (p.m == 0 || p.n == 0 || p.batch == 0) return;
  const double factor = p.alpha * double(*static_cast<const float*>(f.scale_a)) * double(*static_cast<const float*>(f.scale_b));
  const int64_t rows_a = p.trans_a ? p.k : p.m, cols_a = p.trans_a ? p.m : p.k;
  const int64_t rows_b = p.trans_b ? p.n : p.k, cols_b = p.trans_b ? p.k : p.n;
  std::vector<float> sums(size_t(p.m * p.n));
  LOOM_DISPATCH_UNQUANTIZED(p.output_dtype, "fp8_gemm", [&] {
    const high_t* bias = p.epilogue == GemmEpilogue::kBias ? static_cast<const high_t*>(p.bias) : nullptr;
    for (int64_t b = 0; b < p.batch; ++b) {
      const uint8_t* a = static_cast<const uint8_t*>(p.a) + b * p.stride_a;
      const uint8_t* bm = static_cast<const uint8_t*>(p.b) + b * p.stride_b;
      high_t* c = static_cast<high_t*>(p.c) + b * p.stride_c;
      if (p.k > 0) {
        std::vector<float> af = decoded(p.input_dtype, a, rows_a, cols_a, p.lda);
        std::vector<float> bf = decoded(f.b_dtype, bm, rows_b, cols_b, p.ldb);
        cblas_sgemm(CblasColMajor, p.trans_a ? CblasTrans : CblasNoTrans, p.trans_b ? CblasTrans : CblasNoTrans,
                    p.m, p.n, p.k, 1.0f, af.data(), p.lda, bf.data(), p.ldb, 0.0f, sums.data(), p.m);
      } else {
        std::fill(sums.begin(), sums.end(), 0.0f);
      }
      cpu::parallel_for(p.n, 64, [&](int64_t jb, int64_t je) {
        for (int64_t j = jb; j < je; ++j)
          for (int64_t i = 0; i < p.m; ++i) {
            double v = factor * double(sums[size_t(j * p.m + i)]);
            if (p.beta != 0) v += p.beta * double(float(c[j * p.ldc + i]));  // beta 0 never reads C (it may be NaN)
            if (bias) v += double(float(bias[i]));
            c[j * p.ldc + i] = high_t(float(v));
          }
      });
    }
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(fp8_amax, kCPU, "native", dtypes(kF32, kBF16), fp8_amax_cpu);
LOOM_REGISTER_KERNEL(fp8_scale, kCPU, "native", dtypes(kF32), fp8_scale_cpu);
LOOM_REGISTER_KERNEL(fp8_quantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), fp8_quantize_cpu);
LOOM_REGISTER_KERNEL(fp8_quantize_transposed, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), fp8_quantize_transposed_cpu);
LOOM_REGISTER_KERNEL(fp8_quantize_transposed_sums, kCPU, "native", dtypes(kF8E4M3, kF8E5M2),
                     fp8_quantize_transposed_sums_cpu);
LOOM_REGISTER_KERNEL(swiglu_quantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), swiglu_quantize_cpu);
LOOM_REGISTER_KERNEL(swiglu_amax, kCPU, "native", dtypes(kF32, kBF16), swiglu_amax_cpu);
LOOM_REGISTER_KERNEL(swiglu_backward_amax, kCPU, "native", dtypes(kF32, kBF16), swiglu_backward_amax_cpu);
LOOM_REGISTER_KERNEL(gelu_amax, kCPU, "native", dtypes(kF32, kBF16), gelu_amax_cpu);
LOOM_REGISTER_KERNEL(gelu_backward_amax, kCPU, "native", dtypes(kF32, kBF16), gelu_backward_amax_cpu);
LOOM_REGISTER_KERNEL(gelu_quantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), gelu_quantize_cpu);
LOOM_REGISTER_KERNEL(gelu_backward_quantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), gelu_backward_quantize_cpu);
LOOM_REGISTER_KERNEL(swiglu_backward_quantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2),
                     swiglu_backward_quantize_cpu);
LOOM_REGISTER_KERNEL(fp8_dequantize, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), fp8_dequantize_cpu);
LOOM_REGISTER_KERNEL(fp8_gemm, kCPU, "native", dtypes(kF8E4M3, kF8E5M2), fp8_gemm_cpu);

}  // namespace loom
