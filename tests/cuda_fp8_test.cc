// The FP8 ops on CUDA against the CPU's reference kernels: quantization, amax and the scale update bit for bit (one
// conversion code for both devices), dequantization value for value; fp8_gemm through cuBLASLt on Ada and Hopper,
// with the CPU's kernel, against a float64 product written here, over the layouts it must copy (every transpose, K
// not a multiple of 16, a misaligned or padded C, batches), both output dtypes, the bias and fast accumulation; a GPU
// without FP8 tensor cores is refused with a clear error; a tiny model trains under --fp8 all and tracks bf16; shadow
// mode holds the FP8 products against the dequantized bf16 ones; the grouped (mixture of experts) layer matches the
// CPU's; SwiGLU's and GELU's activations and the residual norms' outputs quantized where they are made match the
// GPU's unfused ops; the codes written in both layouts match the CPU's.
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <tuple>

#include <cstring>

#include "kernels/fp8_kernel.h"
#include "loom/amp.h"
#include "loom/common/dtype_values.h"
#include "loom/dispatch_modes.h"
#include "loom/fp8.h"
#include "loom/nn/model.h"
#include "loom/ops.h"
#include "loom/ops/moe.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom {
namespace {

const Device kGpu(kCUDA, 0);

bool gpu_has_fp8() {
  try {
    fp8::check_device(kGpu);
    return true;
  } catch (const Error&) {
    return false;
  }
}

#define LOOM_SKIP_WITHOUT_FP8_GPU()                                                               \
  do {                                                                                            \
    LOOM_SKIP_WITHOUT_CUDA();                                                                     \
    if (!gpu_has_fp8()) GTEST_SKIP() << "no FP8 tensor cores (compute capability below 8.9)";    \
  } while (0)

Tensor host_tensor(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i)
    store_element(static_cast<uint8_t*>(t.data()) + i * dtype_size(dtype), dtype, values[i]);
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device()), hb = b.to(Device());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data(), hb.data(), ha.nbytes()) == 0;
}

// The same values, every NaN matching every NaN: a NaN's sign and payload are not part of its value (an x86 product
// keeps its NaN operand's, a GPU's gives the canonical NaN), so the dequantized NaN codes match as NaNs.
bool same_values(const Tensor& a, const Tensor& b) {
  const auto va = test::values(a.to(Device())), vb = test::values(b.to(Device()));
  if (va.size() != vb.size()) return false;
  for (size_t i = 0; i < va.size(); ++i)
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i])))) return false;
  return true;
}

std::vector<double> special_values(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-3, 3);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  for (size_t i = 0; i < v.size(); i += 97) v[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : 1e30;
  for (size_t i = 5; i < v.size(); i += 89) v[i] = 1e-40;
  return v;
}

// 8-bit float codes copy on the GPU as on the CPU: unchanged, into a strided view one byte into its buffer and
// densely; a copy to another dtype is one line.
TEST(CudaFp8, CodesCopyToTheirOwnDtypeOnly) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  for (DType dt : {kF8E4M3, kF8E5M2}) {
    Tensor codes = empty({37, 19}, dt);
    auto* bytes = static_cast<uint8_t*>(codes.data());
    for (int64_t i = 0; i < codes.numel(); ++i) bytes[i] = uint8_t(rng());
    Tensor buffer = empty({19 * 37 * 2 + 1}, dt);
    std::memset(buffer.data(), 0, size_t(buffer.numel()));
    Tensor gpu = buffer.to(kGpu);
    gpu.slice(0, 1, 19 * 37 * 2 + 1).view({19, 74}).slice(1, 0, 74, 2).transpose(0, 1).copy_from(codes.to(kGpu));
    Tensor dense = empty({37, 19}, dt, kGpu);
    dense.copy_from(codes.to(kGpu));
    const Tensor back = gpu.to(Device()), dense_back = dense.to(Device());
    const auto* out = static_cast<const uint8_t*>(back.data());
    const auto* dense_out = static_cast<const uint8_t*>(dense_back.data());
    for (int64_t r = 0; r < 37; ++r)
      for (int64_t c = 0; c < 19; ++c) {
        ASSERT_EQ(out[1 + c * 74 + r * 2], bytes[r * 19 + c]) << dtype_name(dt) << " at " << r << ", " << c;
        ASSERT_EQ(dense_out[r * 19 + c], bytes[r * 19 + c]) << dtype_name(dt) << " at " << r << ", " << c;
      }
    EXPECT_EQ(out[2], 0);
    Tensor f = ones({37, 19}, kF32, kGpu);
    EXPECT_THROW(dense.copy_from(f), Error);
    EXPECT_THROW(f.copy_from(dense), Error);
  }
}

TEST(CudaFp8, QuantizeAmaxAndScaleMatchTheCpuBitForBit) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(1);
  for (DType fp8 : {kF8E4M3, kF8E5M2})
    for (DType xt : {kF32, kBF16})
      for (bool specials : {false, true}) {
        std::vector<double> v = special_values(100003, rng);
        if (!specials)
          for (auto& x : v)
            if (!std::isfinite(x) || std::abs(x) > 1e3) x = 0.5;
        const Tensor x = host_tensor(v, {100003}, xt);
        const Tensor s = host_tensor({37.25}, {1}, kF32);
        Tensor amax_cpu, amax_gpu;
        const Tensor q_cpu = ops::fp8_quantize(x, s, fp8, &amax_cpu);
        const Tensor q_gpu = ops::fp8_quantize(x.to(kGpu), s.to(kGpu), fp8, &amax_gpu);
        EXPECT_TRUE(same_bytes(q_cpu, q_gpu)) << dtype_name(fp8) << " from " << dtype_name(xt);
        EXPECT_TRUE(same_bytes(amax_cpu, amax_gpu)) << "amax " << specials;
        EXPECT_TRUE(same_bytes(ops::fp8_amax(x), ops::fp8_amax(x.to(kGpu))));
        for (DType out : {kF32, kBF16})
          EXPECT_TRUE(same_values(ops::fp8_dequantize(q_cpu, s, out), ops::fp8_dequantize(q_gpu, s.to(kGpu), out)))
              << dtype_name(fp8) << " from " << dtype_name(xt) << " to " << dtype_name(out);
      }
  for (double amax : {3.0, 0.0, double(NAN), double(INFINITY), 1e-39}) {
    Tensor h_cpu = host_tensor({0.5, NAN, 2.0}, {3}, kF32), sc_cpu = host_tensor({9}, {1}, kF32);
    Tensor si_cpu = empty({1}, kF32);
    Tensor h_gpu = h_cpu.to(kGpu), sc_gpu = sc_cpu.to(kGpu), si_gpu = empty({1}, kF32, kGpu);
    ops::fp8_update_scale(host_tensor({amax}, {1}, kF32), h_cpu, sc_cpu, si_cpu, kF8E4M3, 1);
    ops::fp8_update_scale(host_tensor({amax}, {1}, kF32).to(kGpu), h_gpu, sc_gpu, si_gpu, kF8E4M3, 1);
    EXPECT_TRUE(same_bytes(h_cpu, h_gpu) && same_bytes(sc_cpu, sc_gpu) && same_bytes(si_cpu, si_gpu)) << amax;
  }
  // Histories of awkward lengths (the kernel shifts them 32 at a time across a warp's lanes), with NaN, inf and zero
  // among the amaxes, one of them all NaN: the history, the scale and scale_inv as the CPU's, bit for bit.
  std::mt19937_64 history_rng(11);
  for (int64_t n : {1, 2, 16, 31, 32, 33, 64, 70, 1000, 1024, 1500})
    for (int kind = 0; kind < 3; ++kind) {
      std::uniform_real_distribution<double> u(0.0, 1.0);
      std::vector<double> h(static_cast<size_t>(n));
      for (double& v : h) {
        const double r = u(history_rng);
        v = kind == 2 ? double(NAN) : kind == 1 && r < 0.1 ? double(NAN) : kind == 1 && r < 0.15 ? double(INFINITY)
            : r < 0.2 ? 0.0 : std::ldexp(u(history_rng), int(u(history_rng) * 40) - 20);
      }
      const double amax = kind == 2 ? double(NAN) : std::ldexp(u(history_rng), 3);
      Tensor h_cpu = host_tensor(h, {n}, kF32), sc_cpu = host_tensor({9}, {1}, kF32), si_cpu = empty({1}, kF32);
      Tensor h_gpu = h_cpu.to(kGpu), sc_gpu = sc_cpu.to(kGpu), si_gpu = empty({1}, kF32, kGpu);
      ops::fp8_update_scale(host_tensor({amax}, {1}, kF32), h_cpu, sc_cpu, si_cpu, kF8E5M2, 2);
      ops::fp8_update_scale(host_tensor({amax}, {1}, kF32).to(kGpu), h_gpu, sc_gpu, si_gpu, kF8E5M2, 2);
      EXPECT_TRUE(same_bytes(h_cpu, h_gpu)) << "history of " << n << ", kind " << kind;
      EXPECT_TRUE(same_bytes(sc_cpu, sc_gpu) && same_bytes(si_cpu, si_gpu)) << "scale, history of " << n << ", kind "
                                                                             << kind;
    }
}

// The GPU's codes and the CPU's for values each device computes in f32 before quantizing: the same or, where the
// devices' roundings differ (a contracted multiply-add on the GPU), neighbouring codes: the same sign and magnitudes
// one code apart, denormals included (or zeros of either sign beside the smallest magnitude); a NaN or an infinity
// on one device is the same on the other.
void expect_within_a_code(const Tensor& gpu_codes, const Tensor& cpu_codes, DType, const std::string& what) {
  const Tensor g = gpu_codes.to(Device()).contiguous(), c = cpu_codes.contiguous();
  ASSERT_EQ(g.numel(), c.numel()) << what;
  const auto va = test::values(ops::fp8_dequantize(g, host_tensor({1}, {1}, kF32), kF32));
  const auto vb = test::values(ops::fp8_dequantize(c, host_tensor({1}, {1}, kF32), kF32));
  const uint8_t* a = static_cast<const uint8_t*>(g.data());
  const uint8_t* b = static_cast<const uint8_t*>(c.data());
  for (int64_t i = 0; i < g.numel(); ++i) {
    const int ma = a[i] & 0x7f, mb = b[i] & 0x7f;
    const bool same_sign = (a[i] & 0x80) == (b[i] & 0x80);
    const bool special = !std::isfinite(va[size_t(i)]) || !std::isfinite(vb[size_t(i)]);
    ASSERT_TRUE(a[i] == b[i] || (std::isnan(va[size_t(i)]) && std::isnan(vb[size_t(i)])) ||
                (!special && ((same_sign && std::abs(ma - mb) <= 1) || (ma <= 1 && mb <= 1))))
        << what << " element " << i << ": code 0x" << std::hex << int(a[i]) << " on the GPU, 0x" << int(b[i])
        << " on the CPU" << std::dec;
  }
}

// SwiGLU's activation quantized where it is made (swiglu_quantize) on the GPU: the GPU's own swiglu then
// fp8_quantize bit for bit, codes and amax, over sizes that take the vector path and the element loop, the halves of
// one product's rows (row stride 2C), special values, both formats and both input dtypes; and within one code of the
// CPU's (each device rounds its f32 exp on its own).
TEST(CudaFp8, SwigluQuantizeIsTheGpusSwigluThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(4);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {7, 13}, {64, 256}, {33, 1032}})
        for (bool halves : {false, true}) {
          std::vector<double> v = special_values(rows * 2 * cols, rng);
          for (auto& x : v)
            if (std::isfinite(x) && std::abs(x) > 1e3) x = 4.0;
          const Tensor both = host_tensor(v, {rows, 2 * cols}, xt).to(kGpu);
          const Tensor first = ops::narrow(both, 1, 0, cols), second = ops::narrow(both, 1, cols, cols);
          const Tensor gate = halves ? first : ops::contiguous(first), up = halves ? second : ops::contiguous(second);
          const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
          Tensor amax, amax_ref, amax_cpu;
          const Tensor q = ops::fp8_swiglu_quantize(gate, up, s, fp8, &amax);
          const Tensor ref = ops::fp8_quantize(ops::swiglu(gate, up), s, fp8, &amax_ref);
          const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                   std::to_string(rows) + ", " + std::to_string(cols) + "]" + (halves ? " halves" : "");
          EXPECT_TRUE(same_bytes(q, ref)) << what;
          EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
          const Tensor q_cpu = ops::fp8_swiglu_quantize(gate.to(Device()), up.to(Device()), s.to(Device()), fp8,
                                                        &amax_cpu);
          expect_within_a_code(q, q_cpu, fp8, what);
        }
}

// The residual norms writing their bf16 output's FP8 codes (residual_rms_norm_quantize,
// residual_layer_norm_quantize) on the GPU: the GPU's own norm then fp8_quantize bit for bit (codes, amax, residual,
// the statistics) through both kernels (a warp per row for widths that are multiples of 4 up to 2048, a block per
// row otherwise), deltas in x's dtype and bf16, with and without a weight (and the layer norm's bias), special
// values; and within one code of the CPU's (the devices' statistics round apart).
TEST(CudaFp8, ResidualNormQuantizeIsTheGpusNormThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  for (bool centered : {false, true})
    for (DType xt : {kF32, kBF16})
      for (DType fp8 : {kF8E4M3, kF8E5M2})
        for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{3, 7}, {64, 768}, {33, 2048}, {5, 3001}})
          for (int delta_kind : {0, 1, 2}) {
            if (delta_kind == 2 && xt == kBF16) continue;
            std::vector<double> v = special_values(rows * cols, rng);
            for (auto& e : v)
              if (std::isfinite(e) && std::abs(e) > 1e3) e = 2.0;
            const Tensor x = host_tensor(v, {rows, cols}, xt).to(kGpu);
            const Tensor delta = delta_kind ? test::random_tensor({rows, cols}, delta_kind == 1 ? xt : kBF16, -1, 1,
                                                                  rng()).to(kGpu)
                                            : Tensor();
            const Tensor w = rng() % 2 ? test::random_tensor({cols}, xt, 0.5, 1.5, rng()).to(kGpu) : Tensor();
            const Tensor b = centered && rng() % 2 ? test::random_tensor({cols}, xt, -1, 1, rng()).to(kGpu) : Tensor();
            const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
            auto fused = [&](const Tensor& x_, const Tensor& d, const Tensor& w_, const Tensor& b_, const Tensor& s_,
                             Tensor* amax) {
              return centered ? ops::residual_layer_norm_quantize(x_, d, w_, b_, 1e-5, s_, fp8, amax)
                              : ops::residual_rms_norm_quantize(x_, d, w_, 1e-5, s_, fp8, amax);
            };
            Tensor amax, amax_ref;
            const ops::ResidualNormResult f = fused(x, delta, w, b, s, &amax);
            const ops::ResidualNormResult u = centered ? ops::residual_layer_norm(x, delta, w, b, 1e-5, kBF16)
                                                       : ops::residual_rms_norm(x, delta, w, 1e-5, kBF16);
            const Tensor q_ref = ops::fp8_quantize(u.out, s, fp8, &amax_ref);
            const std::string what = std::string(centered ? "layer norm " : "RMS norm ") + dtype_name(xt) + " -> " +
                                     dtype_name(fp8) + " [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                     "] delta " + std::to_string(delta_kind) + (w.defined() ? " weighted" : "") +
                                     (b.defined() ? " biased" : "");
            EXPECT_TRUE(same_bytes(f.out, q_ref)) << what;
            EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
            EXPECT_TRUE(same_bytes(f.rstd, u.rstd)) << what;
            if (centered) {
              EXPECT_TRUE(same_bytes(f.mean, u.mean)) << what;
            }
            if (delta_kind) {
              EXPECT_TRUE(same_bytes(f.residual, u.residual)) << what;
            }
            auto host = [](const Tensor& t) { return t.defined() ? t.to(Device()) : Tensor(); };
            const ops::ResidualNormResult c = fused(host(x), host(delta), host(w), host(b), host(s), nullptr);
            expect_within_a_code(f.out, c.out, fp8, what);
          }
}

// GELU's activation quantized where it is made (gelu_quantize) on the GPU: the GPU's own gelu then fp8_quantize
// bit for bit, codes and amax, over sizes that take the vector path and the element loop (odd lengths, an offset
// view), special values, both formats and input dtypes; and within one code of the CPU's.
TEST(CudaFp8, GeluQuantizeIsTheGpusGeluThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(6);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (int64_t n : {1, 7, 4096, 33 * 1031, 65536 * 3 + 5}) {
        std::vector<double> v = special_values(n + 1, rng);
        const Tensor whole = host_tensor(v, {n + 1}, xt).to(kGpu);
        const Tensor x = ops::narrow(whole, 0, 1, n);  // one element in: not 16-byte aligned
        for (const Tensor& in : {x, ops::contiguous(x)}) {
          const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
          Tensor amax, amax_ref, amax_cpu;
          const Tensor q = ops::fp8_gelu_quantize(in, s, fp8, &amax);
          const Tensor ref = ops::fp8_quantize(ops::gelu(in), s, fp8, &amax_ref);
          const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " n " + std::to_string(n);
          EXPECT_TRUE(same_bytes(q, ref)) << what;
          EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
          const Tensor q_cpu = ops::fp8_gelu_quantize(in.to(Device()), s.to(Device()), fp8, &amax_cpu);
          expect_within_a_code(q, q_cpu, fp8, what);
        }
      }
}

// GELU's backward cast in its own pass (gelu_backward_quantize) on the GPU: the GPU's gelu_backward then
// fp8_quantize_transposed bit for bit (codes, transposed codes, amax) over whole and partial tiles, special values,
// both formats and input dtypes; the column sums within f32 rounding of the GPU's column sums of gelu_backward's
// result and the same bits on a second call; the codes within one of the CPU's.
TEST(CudaFp8, GeluBackwardQuantizeIsTheGpusGeluBackwardThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(8);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 3}, {64, 64}, {65, 130}, {260, 520}, {4096, 3072}, {8196, 1024}}) {
        const Tensor g = host_tensor(special_values(rows * cols, rng), {rows, cols}, xt).to(kGpu);
        const Tensor x = test::random_tensor({rows, cols}, xt, -6, 6, rng()).to(kGpu);
        const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
        Tensor amax, sums, amax_ref, sums_again;
        const ops::Fp8Tensor f = ops::fp8_gelu_backward_quantize(g, x, s, fp8, &amax, &sums);
        const Tensor v = ops::gelu_backward(g, x);
        const ops::Fp8Tensor u = ops::fp8_quantize_transposed(v, s, fp8, &amax_ref);
        Tensor sums_ref = empty({cols}, kF32, kGpu);
        ops::linear_backward_bias_out(v, sums_ref);
        const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                 std::to_string(rows) + ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(same_bytes(f.q, u.q)) << what;
        EXPECT_TRUE(same_bytes(f.qt, u.qt)) << what;
        EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
        ops::fp8_gelu_backward_quantize(g, x, s, fp8, nullptr, &sums_again);
        EXPECT_TRUE(same_bytes(sums, sums_again)) << what << ": the sums are reproducible";
        ASSERT_TRUE(test::sums_near(test::values(sums.to(Device())), test::values(sums_ref.to(Device())), 1e-4))
            << what;
        const ops::Fp8Tensor cpu = ops::fp8_gelu_backward_quantize(g.to(Device()), x.to(Device()), s.to(Device()), fp8);
        expect_within_a_code(f.q, cpu.q, fp8, what);
      }
}

// A plain product's output gradient cast with its bias gradient (fp8_quantize_transposed_sums) on the GPU: the GPU's
// fp8_quantize_transposed bit for bit (codes, transposed codes, amax) over whole and partial tiles and both paths of
// the kernel, special values, both formats and input dtypes; the column sums within f32 rounding of the GPU's
// linear_backward_bias and the same bits on a second call; the codes within one of the CPU's.
TEST(CudaFp8, QuantizeTransposedSumsIsTheGpusCastAndBiasGradient) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(12);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 3}, {64, 64}, {65, 130}, {260, 520}, {4096, 768}, {8196, 1024}, {0, 16}}) {
        const Tensor x = host_tensor(special_values(rows * cols, rng), {rows, cols}, xt).to(kGpu);
        const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
        Tensor amax, sums, amax_ref, sums_again;
        const ops::Fp8Tensor f = ops::fp8_quantize_transposed(x, s, fp8, &amax, &sums);
        const ops::Fp8Tensor u = ops::fp8_quantize_transposed(x, s, fp8, &amax_ref);
        Tensor sums_ref = empty({cols}, kF32, kGpu);
        ops::linear_backward_bias_out(x, sums_ref);
        const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                 std::to_string(rows) + ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(same_bytes(f.q, u.q)) << what;
        EXPECT_TRUE(same_bytes(f.qt, u.qt)) << what;
        EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
        ops::fp8_quantize_transposed(x, s, fp8, nullptr, &sums_again);
        EXPECT_TRUE(same_bytes(sums, sums_again)) << what << ": the sums are reproducible";
        ASSERT_TRUE(test::sums_near(test::values(sums.to(Device())), test::values(sums_ref.to(Device())), 1e-4))
            << what;
        if (rows == 0) continue;
        const ops::Fp8Tensor cpu = ops::fp8_quantize_transposed(x.to(Device()), s.to(Device()), fp8);
        expect_within_a_code(f.q, cpu.q, fp8, what);
      }
}

// SwiGLU's backward cast in its own pass (swiglu_backward_quantize) on the GPU: the GPU's swiglu_backward then
// fp8_quantize_transposed of each gradient with its own scale, bit for bit (codes, transposed codes, both amaxes),
// over whole and partial tiles, special values, both formats and input dtypes; the codes within one of the CPU's.
TEST(CudaFp8, SwigluBackwardQuantizeIsTheGpusSwigluBackwardThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(10);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, cols] :
           std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {64, 64}, {65, 130}, {260, 520}, {4096, 8192}}) {
        const Tensor g = host_tensor(special_values(rows * cols, rng), {rows, cols}, xt).to(kGpu);
        const Tensor gate = test::random_tensor({rows, cols}, xt, -6, 6, rng()).to(kGpu);
        const Tensor up = test::random_tensor({rows, cols}, xt, -4, 4, rng()).to(kGpu);
        const Tensor sg = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
        const Tensor su = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
        Tensor amax_g, amax_u, ref_g, ref_u;
        const ops::SwigluGradientCodes f = ops::fp8_swiglu_backward_quantize(g, gate, up, sg, su, fp8, &amax_g, &amax_u);
        const ops::SwigluGrads v = ops::swiglu_backward(g, gate, up);
        const ops::Fp8Tensor qg = ops::fp8_quantize_transposed(v.grad_gate, sg, fp8, &ref_g);
        const ops::Fp8Tensor qu = ops::fp8_quantize_transposed(v.grad_up, su, fp8, &ref_u);
        const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                 std::to_string(rows) + ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(same_bytes(f.gate.q, qg.q)) << what;
        EXPECT_TRUE(same_bytes(f.gate.qt, qg.qt)) << what;
        EXPECT_TRUE(same_bytes(f.up.q, qu.q)) << what;
        EXPECT_TRUE(same_bytes(f.up.qt, qu.qt)) << what;
        EXPECT_TRUE(same_bytes(amax_g, ref_g)) << what;
        EXPECT_TRUE(same_bytes(amax_u, ref_u)) << what;
        const Device cpu;
        const ops::SwigluGradientCodes c =
            ops::fp8_swiglu_backward_quantize(g.to(cpu), gate.to(cpu), up.to(cpu), sg.to(cpu), su.to(cpu), fp8);
        expect_within_a_code(f.gate.q, c.gate.q, fp8, what + " gate");
        expect_within_a_code(f.up.qt, c.up.qt, fp8, what + " up");
      }
}

// The loss writing its gradient's codes (cross_entropy_with_grad_quantize) on the GPU: the GPU's
// cross_entropy_with_grad then fp8_quantize bit for bit (loss, codes, amax) through the staged kernel (16-bit rows of
// 16-104 KB: GPT-2's vocabulary; more rows than SMs, where a block loops over rows) and the two-pass one (f32, short
// and long rows, a vocabulary limit, ignored rows), both formats; the codes within one of the CPU's.
TEST(CudaFp8, CrossEntropyWithGradQuantizeIsTheGpusLossThenQuantize) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(9);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E5M2, kF8E4M3})
      for (auto [rows, vocab, limit] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {3, 257, -1}, {16, 8200, 8193}, {64, 50304, 50257}, {300, 50304, 50257}, {4, 65536, -1}}) {
        const Tensor logits = test::random_tensor({rows, vocab}, xt, -8, 8, rng()).to(kGpu);
        Tensor targets_host = test::random_indices({rows}, 0, limit < 0 ? vocab : limit, kI64);
        static_cast<int64_t*>(targets_host.data())[rows - 1] = -100;  // an ignored row
        const Tensor targets = targets_host.to(kGpu);
        const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 8) + 8)}, {1}, kF32).to(kGpu);
        Tensor amax, amax_ref;
        const ops::CrossEntropyWithGrad f =
            ops::cross_entropy_with_grad_quantize(logits, targets, -100, ops::Reduction::kMean, limit, s, fp8, &amax);
        const ops::CrossEntropyWithGrad u =
            ops::cross_entropy_with_grad(logits, targets, -100, ops::Reduction::kMean, limit);
        const Tensor q_ref = ops::fp8_quantize(u.grad_logits, s, fp8, &amax_ref);
        const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                 std::to_string(rows) + ", " + std::to_string(vocab) + "]";
        EXPECT_TRUE(same_bytes(f.loss, u.loss)) << what;
        EXPECT_TRUE(same_bytes(f.grad_logits, q_ref)) << what;
        EXPECT_TRUE(same_bytes(amax, amax_ref)) << what;
        const ops::CrossEntropyWithGrad c = ops::cross_entropy_with_grad_quantize(
            logits.to(Device()), targets_host, -100, ops::Reduction::kMean, limit, s.to(Device()), fp8);
        expect_within_a_code(f.grad_logits, c.grad_logits, fp8, what);
      }
}

// Current scaling's amax passes on the GPU (swiglu_amax, swiglu_backward_amax, gelu_amax, gelu_backward_amax,
// cross_entropy_grad_amax): the amax the GPU's fused casts record, bit for bit, over vector and element paths (odd
// widths, halves of one product's rows, views one element in), special values, the loss's staged and two-pass
// kernels with ignored rows and a vocabulary limit; within a 16-bit rounding of the CPU's.
TEST(CudaFp8, AmaxPassesAreTheGpusFusedCastsAmaxes) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(14);
  const Device cpu;
  auto near = [](const Tensor& a, const Tensor& b, double rel) {
    const double x = test::values(a.to(Device()))[0], y = test::values(b.to(Device()))[0];
    return x == y || (std::isnan(x) && std::isnan(y)) || std::abs(x - y) <= rel * std::abs(y);
  };
  const Tensor s = host_tensor({4.0}, {1}, kF32).to(kGpu);
  for (DType xt : {kBF16, kF32})
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {7, 65}, {64, 64}, {260, 520}, {2048, 8192}}) {
      const std::string what = std::string(dtype_name(xt)) + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
      for (int layout = 0; layout < 3; ++layout) {  // separate tensors, halves of one, views one element in
        Tensor gate, up;
        if (layout == 1) {
          const Tensor both = host_tensor(special_values(rows * 2 * cols, rng), {rows, 2 * cols}, xt).to(kGpu);
          gate = ops::narrow(both, 1, 0, cols), up = ops::narrow(both, 1, cols, cols);
        } else {
          const int64_t skip = layout == 2 ? 1 : 0;
          const Tensor g = host_tensor(special_values(rows * cols + skip, rng), {rows * cols + skip}, xt).to(kGpu);
          const Tensor u = test::random_tensor({rows * cols + skip}, xt, -4, 4, rng()).to(kGpu);
          gate = ops::view(ops::narrow(g, 0, skip, rows * cols), {rows, cols});
          up = ops::view(ops::narrow(u, 0, skip, rows * cols), {rows, cols});
        }
        const Tensor measured = ops::fp8_swiglu_amax(gate, up, kF8E4M3);
        ASSERT_TRUE(measured.defined()) << what;
        Tensor fused;
        ops::fp8_swiglu_quantize(gate, up, s, kF8E4M3, &fused);
        EXPECT_TRUE(same_bytes(measured, fused)) << what << " swiglu_amax, layout " << layout;
        EXPECT_TRUE(near(measured, ops::fp8_swiglu_amax(gate.to(cpu), up.to(cpu), kF8E4M3), 8e-3)) << what;
      }
      const Tensor grad = host_tensor(special_values(rows * cols, rng), {rows, cols}, xt).to(kGpu);
      const Tensor gate = test::random_tensor({rows, cols}, xt, -6, 6, rng()).to(kGpu);
      const Tensor up = test::random_tensor({rows, cols}, xt, -4, 4, rng()).to(kGpu);
      const auto [ag, au] = ops::fp8_swiglu_backward_amax(grad, gate, up, kF8E5M2);
      ASSERT_TRUE(ag.defined() && au.defined()) << what;
      Tensor fg, fu;
      ops::fp8_swiglu_backward_quantize(grad, gate, up, s, s, kF8E5M2, &fg, &fu);
      EXPECT_TRUE(same_bytes(ag, fg)) << what << " swiglu_backward_amax's gate";
      EXPECT_TRUE(same_bytes(au, fu)) << what << " swiglu_backward_amax's up";
      const auto [cg, cu] = ops::fp8_swiglu_backward_amax(grad.to(cpu), gate.to(cpu), up.to(cpu), kF8E5M2);
      EXPECT_TRUE(near(ag, cg, 8e-3) && near(au, cu, 8e-3)) << what;
      // GELU's forward and backward (GPT-2's MLP).
      const Tensor ga = ops::fp8_gelu_amax(grad, kF8E4M3), gb = ops::fp8_gelu_backward_amax(grad, gate, kF8E5M2);
      ASSERT_TRUE(ga.defined() && gb.defined()) << what;
      Tensor fa, fb;
      ops::fp8_gelu_quantize(grad, s, kF8E4M3, &fa);
      ops::fp8_gelu_backward_quantize(grad, gate, s, kF8E5M2, &fb);
      EXPECT_TRUE(same_bytes(ga, fa)) << what << " gelu_amax";
      EXPECT_TRUE(same_bytes(gb, fb)) << what << " gelu_backward_amax";
      EXPECT_TRUE(near(ga, ops::fp8_gelu_amax(grad.to(cpu), kF8E4M3), 8e-3)) << what;
      EXPECT_TRUE(near(gb, ops::fp8_gelu_backward_amax(grad.to(cpu), gate.to(cpu), kF8E5M2), 8e-3)) << what;
    }
  for (DType xt : {kBF16, kF32})
    for (auto [rows, vocab, limit] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {3, 257, -1}, {16, 8200, 8193}, {300, 50304, 50257}, {4, 128256, -1}})
      for (ops::Reduction reduction : {ops::Reduction::kMean, ops::Reduction::kSum}) {
        const Tensor logits = test::random_tensor({rows, vocab}, xt, -8, 8, rng()).to(kGpu);
        Tensor targets_host = test::random_indices({rows}, 0, limit < 0 ? vocab : limit, kI64);
        static_cast<int64_t*>(targets_host.data())[rows - 1] = -100;  // an ignored row
        const Tensor targets = targets_host.to(kGpu);
        const std::string what = std::string(dtype_name(xt)) + " [" + std::to_string(rows) + ", " +
                                 std::to_string(vocab) + "]" + (reduction == ops::Reduction::kSum ? " sum" : " mean");
        const Tensor measured = ops::cross_entropy_grad_amax(logits, targets, -100, reduction, limit);
        ASSERT_TRUE(measured.defined()) << what;
        Tensor fused;
        ops::cross_entropy_with_grad_quantize(logits, targets, -100, reduction, limit, s, kF8E5M2, &fused);
        EXPECT_TRUE(same_bytes(measured, fused)) << what << " cross_entropy_grad_amax";
        EXPECT_TRUE(near(measured, ops::cross_entropy_grad_amax(logits.to(cpu), targets_host, -100, reduction, limit),
                         8e-3))
            << what;
      }
}

// The codes in both layouts (fp8_quantize_transposed) on the GPU: the CPU's bit for bit (codes, transposed codes,
// amax) over whole and partial 64 x 64 tiles, odd widths and heights (the element stores), widths of whole 8-element
// runs and heights of 4 rows (the vector stores) with partial tiles, blocks looping over row tiles, special values,
// both formats and input dtypes; and the weight gradient read from them is the product of the row-major codes.
TEST(CudaFp8, QuantizeTransposedMatchesTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  for (DType xt : {kBF16, kF32})
    for (DType fp8 : {kF8E4M3, kF8E5M2})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 1}, {3, 5}, {64, 64}, {65, 130}, {260, 520}, {4096, 768}, {8196, 1024}, {7, 3001},
               {65535 * 64 + 3, 2}}) {
        const Tensor x = host_tensor(special_values(rows * cols, rng), {rows, cols}, xt).to(kGpu);
        const Tensor s = host_tensor({std::ldexp(1.0, int(rng() % 10) - 3)}, {1}, kF32).to(kGpu);
        Tensor amax, amax_cpu;
        const ops::Fp8Tensor g = ops::fp8_quantize_transposed(x, s, fp8, &amax);
        const ops::Fp8Tensor c = ops::fp8_quantize_transposed(x.to(Device()), s.to(Device()), fp8, &amax_cpu);
        const std::string what = std::string(dtype_name(xt)) + " -> " + dtype_name(fp8) + " [" +
                                 std::to_string(rows) + ", " + std::to_string(cols) + "]";
        EXPECT_TRUE(same_bytes(g.q, c.q)) << what;
        EXPECT_TRUE(same_bytes(g.qt, c.qt)) << what;
        EXPECT_TRUE(same_bytes(amax, amax_cpu)) << what;
      }
  if (!gpu_has_fp8()) return;
  const Tensor one = host_tensor({0.5}, {1}, kF32).to(kGpu);
  const ops::Fp8Tensor x = ops::fp8_quantize_transposed(test::random_tensor({4096, 768}, kF32, -2, 2, 1).to(kGpu),
                                                        one, kF8E4M3);
  const ops::Fp8Tensor g = ops::fp8_quantize_transposed(test::random_tensor({4096, 2304}, kF32, -2, 2, 2).to(kGpu),
                                                        one, kF8E5M2);
  Tensor rows_major = empty({2304, 768}, kF32, kGpu), transposed = empty({2304, 768}, kF32, kGpu);
  ops::fp8_linear_backward_weight_out({g.q, one}, {x.q, one}, rows_major);
  ops::fp8_linear_backward_weight_out({g.q, one, g.qt}, {x.q, one, x.qt}, transposed);
  const std::vector<double> a = test::values(rows_major.to(Device())), b = test::values(transposed.to(Device()));
  double largest = 0, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    largest = std::max(largest, std::abs(a[i]));
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  EXPECT_LE(worst, 1e-5 * largest) << "the weight gradient from transposed codes";
}

// A weight gradient from row-major codes (each operand transposed into a K-contiguous buffer before cuBLASLt, 16
// bytes a load and a store where the codes start on 16 bytes with rows of whole 16 bytes, byte by byte elsewhere):
// the product of the same codes given transposed (no transposing pass), and the CPU's within the FP8 tensor cores'
// accumulation. Whole and partial 128 x 128 tiles, K (the rows) padded to 16 with zeros, codes at an odd offset
// (a view one byte into a buffer), both formats of the gradient.
TEST(CudaFp8, WeightGradientOfRowMajorCodesIsTheCpus) {
  LOOM_SKIP_WITHOUT_FP8_GPU();
  std::mt19937_64 rng(11);
  for (auto [rows, out, in, offset] : std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
           {256, 128, 128, false}, {1000, 304, 48, false}, {4099, 2304, 768, false}, {77, 32, 144, true},
           {515, 272, 208, true}, {130, 1040, 64, true}})
    for (DType gt : {kF8E5M2, kF8E4M3}) {
      // The codes (and the same codes transposed) of values in [-2, 2], made on the CPU; the row-major ones copied to
      // the GPU one byte into a buffer when `offset`.
      auto codes = [&](int64_t cols, DType fp8) {
        const Tensor one = host_tensor({1.0}, {1}, kF32);
        const ops::Fp8Tensor c = ops::fp8_quantize_transposed(test::random_tensor({rows, cols}, kF32, -2, 2, rng()),
                                                              one, fp8);
        if (!offset) return std::make_pair(c.q.to(kGpu), c.qt.to(kGpu));
        // The codes one byte into a buffer, placed on the host and moved whole.
        Tensor buffer = empty({rows * cols + 1}, fp8);
        std::memcpy(static_cast<char*>(buffer.data()) + 1, c.q.data(), size_t(rows * cols));
        return std::make_pair(buffer.to(kGpu).slice(0, 1, rows * cols + 1).view({rows, cols}), c.qt.to(kGpu));
      };
      const auto [g, gt_t] = codes(out, gt);
      const auto [x, xt_t] = codes(in, kF8E4M3);
      const Tensor sg = host_tensor({0.75}, {1}, kF32).to(kGpu), sx = host_tensor({1.5}, {1}, kF32).to(kGpu);
      Tensor dw = empty({out, in}, kF32, kGpu), dw_t = empty({out, in}, kF32, kGpu), dw_cpu = empty({out, in}, kF32);
      ops::fp8_linear_backward_weight_out({g, sg}, {x, sx}, dw);
      ops::fp8_linear_backward_weight_out({g, sg, gt_t}, {x, sx, xt_t}, dw_t);
      ops::fp8_linear_backward_weight_out({g.to(Device()), sg.to(Device())}, {x.to(Device()), sx.to(Device())},
                                          dw_cpu);
      const std::vector<double> a = test::values(dw.to(Device())), t = test::values(dw_t.to(Device())),
                                c = test::values(dw_cpu);
      double largest = 0, from_transposed = 0, from_cpu = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        largest = std::max(largest, std::abs(c[i]));
        from_transposed = std::max(from_transposed, std::abs(a[i] - t[i]));
        from_cpu = std::max(from_cpu, std::abs(a[i] - c[i]));
      }
      const std::string what = std::string(dtype_name(gt)) + " [" + std::to_string(rows) + ", " +
                               std::to_string(out) + "] x [" + std::to_string(rows) + ", " + std::to_string(in) +
                               "]" + (offset ? " at an odd offset" : "");
      EXPECT_GT(largest, 0.0) << what;
      EXPECT_LE(from_transposed, 1e-6 * largest) << what << ": against the transposed codes' product";
      // One code misplaced moves an entry by a product of two codes (up to 4 here): about 1% of the largest entry.
      EXPECT_LE(from_cpu, 2e-3 * largest) << what << ": against the CPU";
    }
}

// Every rounding decision of both formats on the GPU's conversion (Ada and up convert with one instruction, the
// CPU with Loom's code): each midpoint between neighbouring codes and the floats either side of it, each code itself,
// the saturation edge, the denormal range, signed zeros, infinities and NaN of either sign, in f32 (no rounding on
// the way in) and in bf16, at a power-of-two scale and at one that rounds its products.
TEST(CudaFp8, QuantizeEveryRoundingBoundaryMatchesTheCpu) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (DType fp8 : {kF8E4M3, kF8E5M2}) {
    std::vector<double> v = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN, 1e30, -1e30, 3.4e38, 1e-45, -1e-45, 1e-40};
    const double max = ops::fp8_max(fp8);
    for (double f : {1.0, 1.0625, 1.125, 1.25, 1.5, 2.0}) v.push_back(max * f), v.push_back(-max * f);
    for (int c = 0; c < 0x7f; ++c) {
      const float lo = fp8 == kF8E4M3 ? fp8_decode<Float8E4M3>(uint8_t(c)) : fp8_decode<Float8E5M2>(uint8_t(c));
      const float hi = fp8 == kF8E4M3 ? fp8_decode<Float8E4M3>(uint8_t(c + 1)) : fp8_decode<Float8E5M2>(uint8_t(c + 1));
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = (lo + hi) / 2;  // exact: both are short binary fractions
      for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) v.push_back(x), v.push_back(-x);
    }
    v.resize((v.size() / 8 + 1) * 8 + 3, 0.75);  // whole vectors and a tail the kernel takes element by element
    for (DType xt : {kF32, kBF16})
      for (double scale : {1.0, 0.37}) {
        const Tensor x = host_tensor(v, {int64_t(v.size())}, xt);
        const Tensor s = host_tensor({scale}, {1}, kF32);
        const Tensor q_cpu = ops::fp8_quantize(x, s, fp8);
        const Tensor q_gpu = ops::fp8_quantize(x.to(kGpu), s.to(kGpu), fp8);
        const Tensor h = q_gpu.to(Device());
        for (int64_t i = 0; i < x.numel(); ++i) {
          uint8_t a = static_cast<const uint8_t*>(q_cpu.data())[i], b = static_cast<const uint8_t*>(h.data())[i];
          // A NaN's sign is not part of its value: x86 keeps the NaN operand's in x * scale, a GPU gives +NaN.
          if (std::isnan(v[size_t(i)])) a &= 0x7f, b &= 0x7f;
          EXPECT_EQ(a, b) << dtype_name(fp8) << " from " << dtype_name(xt) << " at scale " << scale << ": x = "
                          << v[size_t(i)] << " (element " << i << ")";
          if (a != b) break;
        }
      }
  }
}

Tensor random_codes(int64_t n, DType fp8, std::mt19937_64& rng) {
  std::vector<double> v(static_cast<size_t>(n));
  std::normal_distribution<double> g(0, 1);
  for (auto& x : v) x = g(rng) * (fp8 == kF8E4M3 ? 60 : 3000);
  Tensor q = empty({n}, fp8);
  for (size_t i = 0; i < v.size(); ++i)
    static_cast<uint8_t*>(q.data())[i] = fp8 == kF8E4M3 ? fp8_encode<Float8E4M3>(float(v[i]), Fp8Overflow::kSaturate)
                                                        : fp8_encode<Float8E5M2>(float(v[i]), Fp8Overflow::kSaturate);
  return q;
}

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k, batch, ldc_pad, c_offset;
  DType a, b, out;
  bool bias, fast;
  double beta;
};

// The product on `device` of codes held on the host (copied over), C starting at c_offset within its buffer.
Tensor run_gemm(const GemmCase& g, const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb,
                const Tensor& bias, const Tensor& c_init, Device device) {
  const int64_t ldc = g.m + g.ldc_pad;
  // A copy: to() on the tensor's own device returns the tensor itself, and the product writes C in place, so the
  // CPU's run would hand the GPU's a C already holding its result.
  Tensor c = c_init.clone().to(device);
  Tensor ad = a.to(device), bd = b.to(device), sad = sa.to(device), sbd = sb.to(device);
  Tensor biasd = bias.defined() ? bias.to(device) : Tensor();
  Fp8GemmParams f;
  GemmParams& p = f.gemm;
  p.trans_a = g.ta, p.trans_b = g.tb, p.m = g.m, p.n = g.n, p.k = g.k, p.batch = g.batch;
  p.a = ad.data(), p.lda = g.ta ? g.k : g.m, p.stride_a = g.m * g.k;
  p.b = bd.data(), p.ldb = g.tb ? g.n : g.k, p.stride_b = g.n * g.k;
  p.c = static_cast<uint8_t*>(c.data()) + g.c_offset * int64_t(dtype_size(g.out)), p.ldc = ldc;
  p.stride_c = ldc * g.n;
  p.beta = g.beta, p.alpha = 0.75;
  p.input_dtype = g.a, p.output_dtype = g.out, p.device = device;
  p.epilogue = g.bias ? GemmEpilogue::kBias : GemmEpilogue::kNone;
  p.bias = g.bias ? biasd.data() : nullptr;
  f.b_dtype = g.b, f.scale_a = sad.data(), f.scale_b = sbd.data(), f.fast_accumulation = g.fast;
  validate_fp8_gemm_params(f);
  dispatch::call(fp8_gemm_op, device, g.a, f);
  return c.to(Device());
}

// The whole C buffer (padding and the elements before C's start included) in float64, from the codes as decoded
// here: alpha * scale_a * scale_b * op(A) op(B) + beta * C + bias where C is, C's first value elsewhere.
std::vector<double> reference_gemm(const GemmCase& g, const Tensor& a, const Tensor& b, double sa, double sb,
                                   const Tensor& bias, const Tensor& c0) {
  auto decode = [](DType t, uint8_t code) {
    return double(t == kF8E4M3 ? fp8_decode<Float8E4M3>(code) : fp8_decode<Float8E5M2>(code));
  };
  const auto* ac = static_cast<const uint8_t*>(a.data());
  const auto* bc = static_cast<const uint8_t*>(b.data());
  std::vector<double> out = test::values(c0);
  const std::vector<double> bv = g.bias ? test::values(bias) : std::vector<double>();
  const int64_t ldc = g.m + g.ldc_pad, lda = g.ta ? g.k : g.m, ldb = g.tb ? g.n : g.k;
  for (int64_t s = 0; s < g.batch; ++s)
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t i = 0; i < g.m; ++i) {
        double sum = 0;
        for (int64_t kk = 0; kk < g.k; ++kk) {
          const int64_t ai = s * g.m * g.k + (g.ta ? kk + i * lda : i + kk * lda);
          const int64_t bi = s * g.n * g.k + (g.tb ? j + kk * ldb : kk + j * ldb);
          sum += decode(g.a, ac[ai]) * decode(g.b, bc[bi]);
        }
        double& c = out[size_t(g.c_offset + s * ldc * g.n + j * ldc + i)];
        c = 0.75 * sa * sb * sum + (g.beta != 0 ? g.beta * c : 0.0) + (g.bias ? bv[size_t(i)] : 0.0);
      }
  return out;
}

std::string describe(const GemmCase& g) {
  std::ostringstream o;
  o << "trans " << g.ta << g.tb << " m " << g.m << " n " << g.n << " k " << g.k << " batch " << g.batch << " A "
    << dtype_name(g.a) << " B " << dtype_name(g.b) << " out " << dtype_name(g.out) << " ldc pad " << g.ldc_pad
    << " C offset " << g.c_offset << " beta " << g.beta << (g.bias ? " bias" : "") << (g.fast ? " fast" : "");
  return o.str();
}

// How `got` (the whole C buffer) differs from the float64 reference: "" when within tol of every element, else the
// count, the worst element, and the factors on the scaled product and on C that the elements imply (a wrong scale
// shows as one factor, a lost C term as a beta of 0, a misplaced result as a spread).
std::string mismatch(const GemmCase& g, const std::vector<double>& ref, const std::vector<double>& got,
                     const std::vector<double>& c, const std::vector<double>& bias, double tol) {
  double rms = 0;
  for (double x : ref) rms += x * x;
  rms = std::sqrt(rms / double(ref.size()));
  size_t bad = 0, worst = 0;
  double worst_err = 0;
  for (size_t e = 0; e < ref.size(); ++e) {
    const double err = std::abs(got[e] - ref[e]) / (std::abs(ref[e]) + rms);
    if (!(err <= tol)) ++bad;
    if (!(err <= worst_err)) worst_err = err, worst = e;
  }
  if (bad == 0) return "";
  const int64_t ldc = g.m + g.ldc_pad;
  double lo_ab = 1e300, hi_ab = -1e300, lo_c = 1e300, hi_c = -1e300;
  for (int64_t s = 0; s < g.batch; ++s)
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t i = 0; i < g.m; ++i) {
        const size_t e = size_t(g.c_offset + s * ldc * g.n + j * ldc + i);
        const double ci = g.beta * c[e], bi = g.bias ? bias[size_t(i)] : 0.0, ab = ref[e] - ci - bi;
        if (std::abs(ab) > 1e-2 * rms) lo_ab = std::min(lo_ab, (got[e] - ci - bi) / ab), hi_ab = std::max(hi_ab, (got[e] - ci - bi) / ab);
        if (g.beta != 0 && std::abs(c[e]) > 0.25)
          lo_c = std::min(lo_c, (got[e] - ab - bi) / c[e]), hi_c = std::max(hi_c, (got[e] - ab - bi) / c[e]);
      }
  std::ostringstream o;
  o << bad << " of " << ref.size() << " elements off; worst at " << worst << ": " << got[worst] << " for "
    << ref[worst] << "; factor on the scaled product " << lo_ab << " .. " << hi_ab;
  if (g.beta != 0) o << "; implied beta " << lo_c << " .. " << hi_c;
  return o.str();
}

TEST(CudaFp8, GemmThroughCublasLtMatchesFloat64) {
  LOOM_SKIP_WITHOUT_FP8_GPU();
  std::mt19937_64 rng(2);
  std::vector<GemmCase> cases;
  for (int trans = 0; trans < 4; ++trans)
    for (DType out : {kBF16, kF32})
      cases.push_back({bool(trans & 1), bool(trans & 2), 64, 48, 128, 1, 0, 0, kF8E4M3, kF8E4M3, out, true, false, 0});
  cases.push_back({true, false, 96, 32, 40, 1, 0, 0, kF8E4M3, kF8E5M2, kBF16, true, false, 0});   // K % 16 != 0
  // An odd C (padded ldc, misaligned start: the staged output), e5m2 as A, a batch of 2, beta and the bias; then
  // the same with one thing changed at a time, so a failure names its cause. (M = 33, N = 17 has no cuBLASLt FP8
  // algorithm on an H200: supports() declines it.)
  const GemmCase odd{false, true, 48, 32, 64, 2, 3, 1, kF8E5M2, kF8E4M3, kF32, true, false, 0.5};
  cases.push_back(odd);
  for (int variant = 0; variant < 5; ++variant) {
    GemmCase v = odd;
    if (variant == 0) v.a = kF8E4M3, v.b = kF8E5M2;      // the other mixed pair
    if (variant == 1) v.batch = 1;                        // one problem
    if (variant == 2) v.beta = 0;                         // C not read
    if (variant == 3) v.bias = false;                     // no bias
    if (variant == 4) v.ldc_pad = 0, v.c_offset = 0;      // C aligned: cuBLASLt writes it in place
    cases.push_back(v);
  }
  cases.push_back({true, false, 128, 256, 512, 1, 0, 0, kF8E4M3, kF8E4M3, kBF16, false, true, 0});  // fast
  cases.push_back({true, false, 64, 64, 4096, 1, 0, 0, kF8E4M3, kF8E5M2, kF32, false, false, 1.0});  // long K
  const double scale_a = 1.0 / 64, scale_b = 0.0078125 * 3;
  for (const GemmCase& g : cases) {
    const Tensor a = random_codes(g.batch * g.m * g.k, g.a, rng), b = random_codes(g.batch * g.n * g.k, g.b, rng);
    const Tensor sa = host_tensor({scale_a}, {1}, kF32), sb = host_tensor({scale_b}, {1}, kF32);
    const Tensor bias = g.bias ? test::random_tensor({g.m}, g.out) : Tensor();
    const int64_t c_elems = g.c_offset + (g.m + g.ldc_pad) * g.n * g.batch;
    const Tensor c0 = test::random_tensor({c_elems}, g.out);
    const std::vector<double> ref = reference_gemm(g, a, b, scale_a, scale_b, bias, c0);
    const auto c = test::values(c0), bv = g.bias ? test::values(bias) : std::vector<double>();
    // f32: the FP8 tensor cores' accumulation (narrower within K blocks, fast accumulation narrower still); bf16:
    // the output's rounding.
    const double tol = g.out == kBF16 ? 1.6e-2 : (g.fast ? 1e-2 : 2e-3);
    const std::string cpu = mismatch(g, ref, test::values(run_gemm(g, a, b, sa, sb, bias, c0, Device())), c, bv, tol);
    const std::string gpu = mismatch(g, ref, test::values(run_gemm(g, a, b, sa, sb, bias, c0, kGpu)), c, bv, tol);
    EXPECT_EQ(cpu, "") << "CPU, " << describe(g);
    EXPECT_EQ(gpu, "") << "GPU, " << describe(g);
  }
}

TEST(CudaFp8, RefusedWithoutFp8TensorCores) {
  LOOM_SKIP_WITHOUT_CUDA();
  if (gpu_has_fp8()) GTEST_SKIP() << "this GPU has FP8 tensor cores";
  try {
    fp8::check_device(kGpu);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute capability 8.9"), std::string::npos) << e.what();
  }
}

TEST(CudaFp8, ShadowHoldsTheFp8ProductsAgainstDequantizedBf16) {
  LOOM_SKIP_WITHOUT_FP8_GPU();
  dispatch::reset_shadow_stats();
  test::ScopedPolicy policy("shadow=dequantized:fp8_gemm");
  // An absolute tolerance near the outputs' size times 1e-3: grad_w's elements sum 256 products and reach about 10,
  // and where they cancel to near 0 the FP8 tensor cores' accumulation leaves an error of a few 1e-3 against the
  // exact bf16 product (seen: 0.19898 for 0.20201 on an H200). A wrong scale, operand or layout is off by far more.
  dispatch::set_shadow_tolerance(kF32, 2e-3, 1e-2);
  auto state = std::make_shared<fp8::LinearState>(fp8::Recipe{});
  for (int i = 0; i < 3; ++i) {
    Tensor x = test::random_tensor({256, 512}, kBF16, -1, 1, test::fresh_seed(), kGpu).set_requires_grad(true);
    Tensor w = test::random_tensor({384, 512}, kF32, -0.1, 0.1, test::fresh_seed(), kGpu).set_requires_grad(true);
    sum(fp8::linear(x, w, Tensor(), state)).backward();
  }
  dispatch::set_shadow_tolerance(kF32, 1e-4, 1e-5);
  const auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("fp8_gemm@dequantized"));
  const auto& s = stats.at("fp8_gemm@dequantized");
  EXPECT_EQ(s.runs, 9u);  // forward, grad_x, grad_w, three times
  EXPECT_EQ(s.divergences, 0u) << s.last_divergence;
}

// The grouped layer (a mixture of experts' products) on the GPU against the CPU's: the same codes (quantization is
// bit-exact across devices), so the outputs and both gradients differ by their sums only. Not by f32 rounding alone:
// Hopper's FP8 tensor cores keep about 14 bits of a running sum (truncated) within the products of a K block, even
// where cuBLASLt promotes to f32 between blocks, so an output may be off by a few 2^-13 of the size of its sum's terms
// (sum |a| |b|; seen on an H200: 1.5e-3 at a sum whose terms add to about 10). Each element's bound is 2^-10 of that
// size, plus a bf16 result's rounding; a wrong code, scale, layout or group is off by far more. Groups of awkward sizes
// (empty, one row, off every 16), rows past the groups, K off 16 (the packed layouts), f32 and bf16 inputs.
// The second set of sizes meets the plans the first made: its new row counts borrow their size bucket's algorithms.
TEST(CudaFp8, GroupedLinearMatchesTheCpu) {
  LOOM_SKIP_WITHOUT_FP8_GPU();
  const int64_t rows = 200, in = 72, out = 40;
  const std::vector<std::vector<int64_t>> size_sets{{37, 0, 1, 130, 16, 9}, {40, 3, 0, 127, 20, 6}};
  for (const std::vector<int64_t>& sizes : size_sets) {
    for (DType xt : {kF32, kBF16}) {
      Tensor x = test::random_tensor({rows, in}, kF32, -2, 2, test::fresh_seed()).to(xt);
      Tensor w = test::random_tensor({int64_t(sizes.size()), out, in}, kF32, -0.3, 0.3, test::fresh_seed());
      Tensor dy = test::random_tensor({rows, out}, kF32, -1, 1, test::fresh_seed()).to(xt);
      std::vector<std::vector<double>> got[2];
      for (int d = 0; d < 2; ++d) {
        const Device device = d ? kGpu : Device();
        Tensor xd = x.to(device).detach().set_requires_grad(true);
        Tensor wd = w.to(device).detach().set_requires_grad(true);
        fp8::Recipe exact;  // the forward summed in f32 too: the GPU's fast accumulation differs by more than rounding
        exact.fast_accumulation_forward = false;
        Tensor y = fp8::grouped_linear(xd, wd, sizes, std::make_shared<fp8::LinearState>(exact));
        y.backward(dy.to(device));
        for (const Tensor& t : {y, xd.grad(), wd.grad()}) got[d].push_back(test::values(t.to(Device())));
      }
      // The size of each element's terms, sum |a| |b|, from the unquantized values (within FP8's 2^-4 of the codes').
      const Tensor ax = ops::abs(x.to(kF32)), aw = ops::abs(w), ady = ops::abs(dy.to(kF32));
      const std::vector<double> terms[3] = {test::values(ops::grouped_gemm(ax, aw, sizes, true)),
                                            test::values(ops::grouped_gemm(ady, aw, sizes, false)),
                                            test::values(ops::grouped_gemm_weight_grad(ax, ady, sizes, true))};
      const char* names[] = {"y", "grad_x", "grad_w"};
      for (size_t i = 0; i < 3; ++i) {
        double rms = 0;
        for (double v : got[0][i]) rms += v * v;
        rms = std::sqrt(rms / double(got[0][i].size()));
        const double rounding = xt == kBF16 && i < 2 ? 1e-2 : 0;  // bf16 outputs round to 2^-8
        ASSERT_EQ(got[0][i].size(), got[1][i].size());
        ASSERT_EQ(terms[i].size(), got[0][i].size());
        for (size_t j = 0; j < got[0][i].size(); ++j)
          ASSERT_NEAR(got[1][i][j], got[0][i][j], 0x1p-10 * terms[i][j] + rounding * (std::abs(got[0][i][j]) + rms))
              << names[i] << " element " << j << ", " << dtype_name(xt) << " rows";
      }
      int64_t used = 0;
      for (int64_t n : sizes) used += n;
      for (int64_t r = used; r < rows; ++r)
        for (int64_t c = 0; c < out; ++c)
          ASSERT_EQ(got[1][0][size_t(r * out + c)], 0.0) << "row " << r << " is past the groups";
    }
  }
}

TEST(CudaFp8, TinyGpt2UnderFp8TracksBf16) {
  LOOM_SKIP_WITHOUT_FP8_GPU();
  std::vector<double> bf16, fp8;
  for (bool use_fp8 : {false, true}) {
    nn::ModelConfig cfg = nn::ModelConfig::from_name("gpt2-tiny");
    cfg.fp8 = use_fp8 ? fp8::Scope::kAll : fp8::Scope::kOff;
    auto model = nn::make_model(cfg, 7);
    model->to(kGpu);
    optim::AdamW opt(model->parameters(), {.lr = 3e-3});
    std::mt19937_64 rng(3);
    for (int step = 0; step < 20; ++step) {
      std::vector<int64_t> ids(4 * 64);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(i % 37 + (rng() % 10 == 0 ? rng() % 500 : 0));
      const Tensor x = from_vector(ids, {4, 64}).to(kGpu);
      amp::AutocastGuard autocast(kBF16);
      opt.zero_grad();
      Tensor loss = model->forward_loss(x, x);
      loss.backward();
      opt.step();
      (use_fp8 ? fp8 : bf16).push_back(loss.item<float>());
    }
  }
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_NEAR(fp8[i], bf16[i], 0.05 * bf16[i]) << "step " << i + 1;
}

}  // namespace
}  // namespace loom
