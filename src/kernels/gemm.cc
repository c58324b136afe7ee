// What every device's gemm shares: the TF32 switch, the one validation of a problem (the op layer calls it; kernels
// trust it), GemmParams as generic arguments, and the gemm description.
#include <atomic>

#include "kernels/gemm_kernel.h"
#include "loom/core/tensor.h"

namespace loom {

namespace {
std::atomic<bool> g_allow_tf32{false};
}

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }
ComputeType f32_compute_type(std::optional<bool> override_) {
  return override_.value_or(allow_tf32()) ? ComputeType::kTF32 : ComputeType::kF32;
}

void validate_gemm_params(const GemmParams& p) {
  LOOM_REQUIRE(p.m >= 0 && p.n >= 0 && p.k >= 0 && p.batch >= 0, "gemm: negative size m=", p.m, " n=", p.n,
               " k=", p.k, " batch=", p.batch);
  int64_t rows_a = p.trans_a ? p.k : p.m;
  int64_t rows_b = p.trans_b ? p.n : p.k;
  LOOM_REQUIRE(p.lda >= std::max<int64_t>(1, rows_a), "gemm: lda=", p.lda, " is less than ", rows_a);
  LOOM_REQUIRE(p.ldb >= std::max<int64_t>(1, rows_b), "gemm: ldb=", p.ldb, " is less than ", rows_b);
  LOOM_REQUIRE(p.ldc >= std::max<int64_t>(1, p.m), "gemm: ldc=", p.ldc, " is less than m=", p.m);
  bool needs_bias = p.epilogue == GemmEpilogue::kBias || p.epilogue == GemmEpilogue::kBiasGelu;
  LOOM_REQUIRE(!needs_bias || p.bias, "gemm: the bias epilogue needs a bias pointer");
  if (p.epilogue == GemmEpilogue::kDGelu)
    LOOM_REQUIRE(p.pre_gelu && p.batch == 1 && p.beta == 0.0,
                 "gemm: the GELU-derivative epilogue needs pre_gelu (the pre-activation), batch 1 and beta 0; got batch=",
                 p.batch, " beta=", p.beta);
  if (p.epilogue == GemmEpilogue::kBiasGradB)
    LOOM_REQUIRE(p.bias_grad && p.trans_b && p.ldb == p.n && p.batch == 1 && p.alpha == 1.0,
                 "gemm: the bias-gradient epilogue needs a bias_grad pointer, op(B) as a dense row-major [k, n] "
                 "matrix (trans_b, ldb == n), batch 1 and alpha 1; got trans_b=", p.trans_b, " ldb=", p.ldb, " n=", p.n,
                 " batch=", p.batch, " alpha=", p.alpha);
}

// A matrix as stored, [batch, rows, cols] with strides [batch_stride, 1, ld], over memory Loom does not own here.
// One with no elements may have no memory (a null pointer): it is still the matrix the problem names.
Tensor gemm_matrix_view(const void* data, DType dtype, Device device, int64_t batch, int64_t rows, int64_t cols,
                        int64_t ld, int64_t batch_stride) {
  int64_t span = (batch == 0 || rows == 0 || cols == 0) ? 0 : (batch - 1) * batch_stride + (cols - 1) * ld + rows;
  return from_blob(const_cast<void*>(data), {span}, dtype, device)
      .as_strided({batch, rows, cols}, {batch_stride, 1, ld}, 0);
}
// An optional vector: absent where its pointer is null.
Tensor gemm_vector_view(const void* data, DType dtype, Device device, int64_t n) {
  if (!data) return Tensor();
  return from_blob(const_cast<void*>(data), {n}, dtype, device);
}

// A, B and C are always present, a zero-size one too (k = 0: A and B; m or n = 0: C), with the problem's dtypes,
// shapes and strides whatever its pointer: a null pointer only says it has no elements. The optional operands are
// present as the epilogue says (bias: 1 and 3; bias_grad: 4; pre_gelu: 5, and 2 or 3 where its pointer is set),
// so that an empty bias is not taken for an absent one.
void ArgTraits<GemmParams>::gather(const GemmParams& p, CallArgs& c) {
  const int64_t ra = p.trans_a ? p.k : p.m, ca = p.trans_a ? p.m : p.k;
  const int64_t rb = p.trans_b ? p.n : p.k, cb = p.trans_b ? p.k : p.n;
  const GemmEpilogue e = p.epilogue;
  const bool bias = e == GemmEpilogue::kBias || e == GemmEpilogue::kBiasGelu;
  const bool pre_gelu =
      e == GemmEpilogue::kDGelu || (p.pre_gelu && (e == GemmEpilogue::kGelu || e == GemmEpilogue::kBiasGelu));
  const Device d = p.device;
  c.slots.push_back({gemm_matrix_view(p.a, p.input_dtype, d, p.batch, ra, ca, p.lda, p.stride_a), {}, false});
  c.slots.push_back({gemm_matrix_view(p.b, p.input_dtype, d, p.batch, rb, cb, p.ldb, p.stride_b), {}, false});
  c.slots.push_back({bias ? from_blob(const_cast<void*>(p.bias), {p.m}, p.output_dtype, d) : Tensor(), {}, false});
  c.slots.push_back({gemm_matrix_view(p.c, p.output_dtype, d, p.batch, p.m, p.n, p.ldc, p.stride_c), {}, false});
  c.slots.push_back(
      {pre_gelu ? gemm_matrix_view(p.pre_gelu, p.output_dtype, d, p.batch, p.m, p.n, p.ldc, p.stride_c) : Tensor(),
       {}, false});
  c.slots.push_back({e == GemmEpilogue::kBiasGradB ? from_blob(const_cast<void*>(static_cast<const void*>(p.bias_grad)), {p.n}, p.output_dtype, d) : Tensor(),
                     {}, false});
  auto i = [&](const char* n, int64_t v) { c.attrs.emplace_back(n, AttrValue::of_int(v)); };
  i("trans_a", p.trans_a), i("trans_b", p.trans_b), i("m", p.m), i("n", p.n), i("k", p.k);
  i("lda", p.lda), i("ldb", p.ldb), i("ldc", p.ldc), i("batch", p.batch);
  i("stride_a", p.stride_a), i("stride_b", p.stride_b), i("stride_c", p.stride_c);
  c.attrs.emplace_back("alpha", AttrValue::of_float(p.alpha));
  c.attrs.emplace_back("beta", AttrValue::of_float(p.beta));
  i("compute", int64_t(p.compute)), i("epilogue", int64_t(p.epilogue));
}

// The geometry comes from the views (so copies of them make a problem over the copies); the flags and scalars from
// the attributes.
GemmParams ArgTraits<GemmParams>::build(const CallArgs& c, size_t& next) {
  const Tensor &a = c.slots.at(next).tensor, &b = c.slots.at(next + 1).tensor, &bias = c.slots.at(next + 2).tensor,
               &out = c.slots.at(next + 3).tensor, &pre = c.slots.at(next + 4).tensor,
               &bias_grad = c.slots.at(next + 5).tensor;
  next += 6;
  auto attr = [&](const char* n, double fallback) {
    const AttrValue* v = c.attr(n);
    return v ? v->as_double() : fallback;
  };
  GemmParams p;
  p.trans_a = attr("trans_a", 0) != 0;
  p.trans_b = attr("trans_b", 0) != 0;
  p.alpha = attr("alpha", 1);
  p.beta = attr("beta", 0);
  p.compute = ComputeType(int(attr("compute", 0)));
  p.epilogue = GemmEpilogue(int(attr("epilogue", 0)));
  LOOM_REQUIRE(out.defined() && a.defined() && b.defined(), "gemm: A, B and C are required");
  p.batch = out.size(0), p.m = out.size(1), p.n = out.size(2);
  p.k = p.trans_a ? a.size(1) : a.size(2);
  auto data = [](const Tensor& t) { return t.defined() ? t.data() : nullptr; };
  p.a = a.data(), p.lda = a.stride(2), p.stride_a = a.stride(0);
  p.b = b.data(), p.ldb = b.stride(2), p.stride_b = b.stride(0);
  p.c = out.data(), p.ldc = out.stride(2), p.stride_c = out.stride(0);
  p.bias = data(bias), p.pre_gelu = data(pre), p.bias_grad = data(bias_grad);
  p.input_dtype = a.dtype(), p.output_dtype = out.dtype();
  p.device = out.device();
  return p;
}

OpSchema gemm_schema() {
  auto a_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_a") ? Shape{c.dim("Bt"), c.dim("K"), c.dim("M")} : Shape{c.dim("Bt"), c.dim("M"), c.dim("K")};
  };
  auto b_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_b") ? Shape{c.dim("Bt"), c.dim("N"), c.dim("K")} : Shape{c.dim("Bt"), c.dim("K"), c.dim("N")};
  };
  return OpSchema()
      .in("a", "Bt M K").layout(Layout::kColumnMajor).shape_fn(a_shape)
      .in("b", "Bt K N").layout(Layout::kColumnMajor).shape_fn(b_shape)
      .in_opt("bias", "M", DTypeRule::kWideOrSame)
      .in_place("c", "Bt M N", DTypeRule::kWideOrSame).layout(Layout::kColumnMajor).ignored_when_zero("beta")
      .out_opt("pre_gelu", "Bt M N", DTypeRule::kWideOrSame).layout(Layout::kColumnMajor)
      .out_opt("bias_grad", "N", DTypeRule::kWideOrSame).omit_when_absent()
      .attr("trans_a", {0.0, 1.0}).attr("trans_b", {0.0, 1.0}).attr("alpha", {1.0, -0.5, 0.0})
      .attr("beta", {0.0, 1.0, 0.75}).attr("epilogue", {0.0, 1.0, 2.0, 3.0, 4.0, 5.0})
      .dim("Bt", {1, 2, 3}, 1).dim("K", {0}).row_dim("M").row_dim("N").row_dim("K").accumulates("K").long_dim("K", 65537)
      .size_case({{"Bt", 8193}})  // a batch past 2^13: B x H heads of a large attention batch, unfused
      .dispatch_on("a").autocast(Autocast::kCastInputs)
      .special_values("IEEE, as the float64 sum: NaN and inf in A, B, bias or C (beta != 0) reach the elements they "
                      "touch (inf - inf and 0 * inf give NaN); beta == 0 ignores C (it may hold NaN); alpha == 0 gives "
                      "beta * C plus the epilogue, and whether NaN or inf in A or B still reaches C is left to the "
                      "library (BLAS does not read A and B then), so the suite gives finite A and B with alpha 0")
      .case_rule([](SuiteCase& c, const OpSchema& s) {
        auto idx = [&](const char* n) { return size_t(s.tensor_index(n)); };
        const auto e = GemmEpilogue(c.attr_int("epilogue"));
        c.attr("compute")->i = int64_t(c.dtype == kF64 ? ComputeType::kF64 : ComputeType::kF32);
        c.present[idx("a")] = c.present[idx("b")] = c.present[idx("c")] = true;
        c.present[idx("bias")] = e == GemmEpilogue::kBias || e == GemmEpilogue::kBiasGelu;
        if (e != GemmEpilogue::kGelu && e != GemmEpilogue::kBiasGelu) c.present[idx("pre_gelu")] = false;
        c.present[idx("bias_grad")] = e == GemmEpilogue::kBiasGradB;
        if (e == GemmEpilogue::kBiasGradB) {  // op(B) a dense row-major [k, n] matrix, one problem, alpha 1
          c.attr("trans_b")->i = 1;
          c.attr("alpha")->f = 1;
          c.dim("Bt") = 1;
          c.dense[idx("b")] = true;
        }
        if (e == GemmEpilogue::kDGelu) {  // reads the pre-activation; one problem, beta 0
          c.present[idx("pre_gelu")] = true;
          c.roles[idx("pre_gelu")] = ArgRole::kInPlace;
          c.dim("Bt") = 1;
          c.attr("beta")->f = 0;
        }
        if (c.attr_float("alpha") == 0 && !c.values.empty())  // NaN or inf in A or B is unspecified with alpha 0
          for (const char* n : {"a", "b"})
            if (c.values[idx(n)] == ValueClass::kSpecial) c.values[idx(n)] = ValueClass::kNormal;
        // pre_gelu shares C's layout.
        if (c.present[idx("pre_gelu")]) c.dense[idx("pre_gelu")] = c.dense[idx("c")] = true;
      });
}

}  // namespace loom
