// What every device's FP8 ops share: fp8_gemm's problem as generic arguments, its description and its validation.
#include "kernels/fp8_kernel.h"
#include "loom/core/tensor.h"

namespace loom {

void ArgTraits<Fp8GemmParams>::gather(const Fp8GemmParams& f, CallArgs& c) {
  const GemmParams& p = f.gemm;
  const int64_t ra = p.trans_a ? p.k : p.m, ca = p.trans_a ? p.m : p.k;
  const int64_t rb = p.trans_b ? p.n : p.k, cb = p.trans_b ? p.k : p.n;
  c.slots.push_back({gemm_matrix_view(p.a, p.input_dtype, p.device, p.batch, ra, ca, p.lda, p.stride_a), {}, false});
  c.slots.push_back({gemm_matrix_view(p.b, f.b_dtype, p.device, p.batch, rb, cb, p.ldb, p.stride_b), {}, false});
  c.slots.push_back({gemm_vector_view(f.scale_a, kF32, p.device, 1), {}, false});
  c.slots.push_back({gemm_vector_view(f.scale_b, kF32, p.device, 1), {}, false});
  c.slots.push_back({gemm_vector_view(p.bias, p.output_dtype, p.device, p.m), {}, false});
  c.slots.push_back({gemm_matrix_view(p.c, p.output_dtype, p.device, p.batch, p.m, p.n, p.ldc, p.stride_c), {}, false});
  auto i = [&](const char* n, int64_t v) { c.attrs.emplace_back(n, AttrValue::of_int(v)); };
  i("trans_a", p.trans_a), i("trans_b", p.trans_b), i("m", p.m), i("n", p.n), i("k", p.k);
  i("lda", p.lda), i("ldb", p.ldb), i("ldc", p.ldc), i("batch", p.batch);
  i("stride_a", p.stride_a), i("stride_b", p.stride_b), i("stride_c", p.stride_c);
  c.attrs.emplace_back("alpha", AttrValue::of_float(p.alpha));
  c.attrs.emplace_back("beta", AttrValue::of_float(p.beta));
  i("compute", int64_t(p.compute)), i("epilogue", int64_t(p.epilogue));
  i("fast_accumulation", f.fast_accumulation);
}

Fp8GemmParams ArgTraits<Fp8GemmParams>::build(const CallArgs& c, size_t& next) {
  const Tensor &a = c.slots.at(next).tensor, &b = c.slots.at(next + 1).tensor, &sa = c.slots.at(next + 2).tensor,
               &sb = c.slots.at(next + 3).tensor, &bias = c.slots.at(next + 4).tensor,
               &out = c.slots.at(next + 5).tensor;
  next += 6;
  auto attr = [&](const char* n, double fallback) {
    const AttrValue* v = c.attr(n);
    return v ? v->as_double() : fallback;
  };
  LOOM_REQUIRE(out.defined() && a.defined() && b.defined() && sa.defined() && sb.defined(),
               "fp8_gemm: A, B, their scales and C are required");
  Fp8GemmParams f;
  GemmParams& p = f.gemm;
  p.trans_a = attr("trans_a", 0) != 0;
  p.trans_b = attr("trans_b", 0) != 0;
  p.alpha = attr("alpha", 1);
  p.beta = attr("beta", 0);
  p.compute = ComputeType(int(attr("compute", 0)));
  p.epilogue = GemmEpilogue(int(attr("epilogue", 0)));
  p.batch = out.size(0), p.m = out.size(1), p.n = out.size(2);
  p.k = p.trans_a ? a.size(1) : a.size(2);
  p.a = a.data(), p.lda = a.stride(2), p.stride_a = a.stride(0);
  p.b = b.data(), p.ldb = b.stride(2), p.stride_b = b.stride(0);
  p.c = out.data(), p.ldc = out.stride(2), p.stride_c = out.stride(0);
  p.bias = bias.defined() ? bias.data() : nullptr;
  p.input_dtype = a.dtype(), p.output_dtype = out.dtype();
  p.device = out.device();
  f.b_dtype = b.dtype();
  f.scale_a = sa.data(), f.scale_b = sb.data();
  f.fast_accumulation = attr("fast_accumulation", 0) != 0;
  return f;
}

void validate_fp8_gemm_params(const Fp8GemmParams& f) {
  const GemmParams& p = f.gemm;
  validate_gemm_params(p);
  LOOM_REQUIRE(is_fp8(p.input_dtype) && is_fp8(f.b_dtype), "fp8_gemm: A and B must be 8-bit floats, got ",
               dtype_name(p.input_dtype), " and ", dtype_name(f.b_dtype));
  LOOM_REQUIRE(p.output_dtype == kBF16 || p.output_dtype == kF32, "fp8_gemm: C must be bf16 or f32, got ",
               dtype_name(p.output_dtype));
  LOOM_REQUIRE(p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kBias,
               "fp8_gemm: only the bias epilogue is offered, got epilogue ", int(p.epilogue));
  LOOM_REQUIRE(p.compute == ComputeType::kF32, "fp8_gemm: products are summed in f32 (compute 0), got compute ",
               int(p.compute));
  LOOM_REQUIRE(f.scale_a && f.scale_b, "fp8_gemm: both scales are required");
}

OpSchema fp8_gemm_schema() {
  auto a_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_a") ? Shape{c.dim("Bt"), c.dim("K"), c.dim("M")} : Shape{c.dim("Bt"), c.dim("M"), c.dim("K")};
  };
  auto b_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_b") ? Shape{c.dim("Bt"), c.dim("N"), c.dim("K")} : Shape{c.dim("Bt"), c.dim("K"), c.dim("N")};
  };
  const std::vector<ValueClass> codes{ValueClass::kNormal, ValueClass::kLarge, ValueClass::kSpecial, ValueClass::kTiny};
  return OpSchema()
      .in("a", "Bt M K").layout(Layout::kColumnMajor).shape_fn(a_shape).value_classes(codes)
      .in("b", "Bt K N", DTypeRule::kFp8).layout(Layout::kColumnMajor).shape_fn(b_shape).value_classes(codes)
      .in("scale_a", "1", DTypeRule::kF32).values(Values::kScale)
      .in("scale_b", "1", DTypeRule::kF32).values(Values::kScale)
      .in_opt("bias", "M", DTypeRule::kUnquantized)
      .in_place("c", "Bt M N", DTypeRule::kUnquantized).layout(Layout::kColumnMajor).ignored_when_zero("beta")
      .attr("trans_a", {0.0, 1.0}).attr("trans_b", {0.0, 1.0}).attr("alpha", {1.0, -0.5, 0.0})
      .attr("beta", {0.0, 1.0, 0.75}).attr("epilogue", {0.0, 1.0}).attr("fast_accumulation", {0.0, 1.0})
      .dim("Bt", {1, 2, 3}, 1).dim("K", {0}).row_dim("M").row_dim("N").row_dim("K").accumulates("K")
      .long_dim("K", 65537).dispatch_on("a").abi_since(3)
      // A GPU's FP8 tensor cores add products in fewer bits than f32 within each block of K before promoting the
      // partial sum (and, with fast_accumulation, not at all).
      .tolerance(kF32, 1e-3, 1e-3)
      .special_values("IEEE, as the float64 sum of the decoded products: NaN and inf codes (and inf * 0) reach the "
                      "elements they touch; beta == 0 ignores C; alpha == 0 gives beta * C plus the bias, A and B "
                      "then finite (as gemm)")
      .case_rule([](SuiteCase& c, const OpSchema& s) {
        auto idx = [&](const char* n) { return size_t(s.tensor_index(n)); };
        c.attr("compute")->i = int64_t(ComputeType::kF32);
        c.present[idx("bias")] = GemmEpilogue(c.attr_int("epilogue")) == GemmEpilogue::kBias;
        if (c.attr_float("alpha") == 0 && !c.values.empty())
          for (const char* n : {"a", "b"})
            if (c.values[idx(n)] == ValueClass::kSpecial) c.values[idx(n)] = ValueClass::kNormal;
      });
}

}  // namespace loom
