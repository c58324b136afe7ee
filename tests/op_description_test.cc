// Op descriptions (op_schema.h): every declared op has one and is reachable through the kernel ABI; and the worked
// example of docs/ARCHITECTURE.md, an op declared here with its description and one CPU kernel, which then reaches
// the conformance suite, the ABI's generic packing, shadow mode and autotune with no further code.
#include <cmath>

#include "kernels/gemm_kernel.h"
#include "loom/abi/loom_kernel_abi.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/dispatch_modes.h"
#include "providers/conformance.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {

// ---- The worked example: out = x * scale + shift, in place of nothing, any strides for x. ----
struct ScaleShiftAttrs {
  double scale = 1.0;
  double shift = 0.0;
  LOOM_FIELDS(ScaleShiftAttrs, scale, shift);
};
using ScaleShiftKernel = void(const DeviceContext&, const Tensor& x, const ScaleShiftAttrs&, Tensor& out);
LOOM_DECLARE_OP(example_scale_shift, ScaleShiftKernel,
                OpSchema().in("x", "R C").layout(Layout::kStrided).out("out", "R C")
                    .attr("scale", {1.0, -2.5}).attr("shift", {0.0, 0.75}));

namespace {

// One CPU kernel for f32 and f64, written against the contract above (x may be strided; out is dense).
template <typename T>
void scale_shift_typed(const Tensor& x, const ScaleShiftAttrs& a, Tensor& out, double error) {
  const T* xs = static_cast<const T*>(x.data());
  T* o = static_cast<T*>(out.data());
  for (int64_t r = 0; r < x.size(0); ++r)
    for (int64_t c = 0; c < x.size(1); ++c) {
      double v = double(xs[r * x.stride(0) + c * x.stride(1)]) * a.scale + a.shift;
      if (c == 12) v += error;  // the wrong kernel: one column off
      o[r * out.stride(0) + c * out.stride(1)] = T(v);
    }
}
void scale_shift_cpu(const DeviceContext&, const Tensor& x, const ScaleShiftAttrs& a, Tensor& out) {
  if (x.dtype() == kF64) scale_shift_typed<double>(x, a, out, 0);
  else scale_shift_typed<float>(x, a, out, 0);
}
void scale_shift_wrong(const DeviceContext&, const Tensor& x, const ScaleShiftAttrs& a, Tensor& out) {
  if (x.dtype() == kF64) scale_shift_typed<double>(x, a, out, 0.01);
  else scale_shift_typed<float>(x, a, out, 0.01);
}
LOOM_REGISTER_KERNEL(example_scale_shift, kCPU, "native", dtypes(kF32, kF64), scale_shift_cpu);

std::vector<conformance::CaseResult> suite_for(const std::string& provider) {
  conformance::SuiteOptions o;
  o.provider = provider;
  o.ops = {"example_scale_shift"};
  return conformance::run_suite(o);
}

struct Unregister {
  std::vector<std::string> providers;
  ~Unregister() {
    for (const auto& p : providers) dispatch::unregister_provider(p);
    dispatch::reset_policy();
  }
};

TEST(OpDescription, TheWorkedExampleReachesConformance) {
  const OpSchema* s = find_op_schema("example_scale_shift");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->str(), "example_scale_shift(x [R C], scale, shift) -> out [R C] (dispatched on out)");
  auto results = suite_for("native");
  EXPECT_GT(results.size(), 100u);  // both dtypes, every size of R and C, every attribute pair, strided x
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");

  Unregister u{{"example_wrong"}};
  dispatch::register_kernel(example_scale_shift_op, kCPU, "example_wrong", dtypes(kF32), scale_shift_wrong);
  auto wrong = suite_for("example_wrong");
  EXPECT_TRUE(conformance::suite_failed(wrong));
  std::string table = conformance::suite_table(wrong, "loom-conformance --provider example_wrong");
  EXPECT_NE(table.find("FAIL example_scale_shift f32"), std::string::npos) << table;
  EXPECT_NE(table.find("--op example_scale_shift --dtype f32 --case"), std::string::npos) << table;
}

// What the ABI loader does for a library's op entry: an erased kernel that sees descriptors and attributes by name.
TEST(OpDescription, TheWorkedExampleReachesTheAbiPackingShadowAndAutotune) {
  const OpSchema* s = find_op_schema("example_scale_shift");
  ASSERT_NE(s, nullptr);
  Unregister u{{"example_abi"}};
  int calls = 0;
  s->register_erased(
      kCPU, "example_abi", dtypes(kF32), 0,
      [&](const DeviceContext&, const CallArgs& args) {
        ++calls;
        ASSERT_EQ(args.slots.size(), 2u);
        const AttrValue *scale = args.attr("scale"), *shift = args.attr("shift");
        ASSERT_TRUE(scale && shift);
        ScaleShiftAttrs a{scale->f, shift->f};
        Tensor out = args.slots[1].tensor;
        scale_shift_typed<float>(args.slots[0].tensor, a, out, 0);
      },
      nullptr, "test");
  auto results = suite_for("example_abi");
  EXPECT_GT(calls, 50);
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");

  // Shadow mode compares the erased kernel with native: no divergence.
  dispatch::reset_shadow_stats();
  dispatch::set_policy(ProviderPolicy::parse("example_abi:example_scale_shift;shadow=native:example_scale_shift"));
  Tensor x = test::random_tensor({5, 17}), out = empty({5, 17});
  dispatch::call(example_scale_shift_op, Device(), kF32, x, ScaleShiftAttrs{2.0, 1.0}, out);
  auto stats = dispatch::shadow_stats();
  ASSERT_TRUE(stats.count("example_scale_shift@native"));
  EXPECT_EQ(stats["example_scale_shift@native"].runs, 1u);
  EXPECT_EQ(stats["example_scale_shift@native"].divergences, 0u);

  // Autotune times both candidates for the call's key and keeps one.
  dispatch::reset_autotune();
  dispatch::set_policy(ProviderPolicy::parse("autotune=example_scale_shift"));
  dispatch::call(example_scale_shift_op, Device(), kF32, x, ScaleShiftAttrs{2.0, 1.0}, out);
  bool found = false;
  for (const auto& c : dispatch::autotune_choices())
    if (c.op == "example_scale_shift") {
      found = true;
      EXPECT_EQ(c.timings_us.size(), 2u);
    }
  EXPECT_TRUE(found);
  EXPECT_TRUE(test::all_close(out, ops::add(ops::mul(x, 2.0), 1.0), 1e-6, 1e-6));
  dispatch::reset_autotune();
}

TEST(OpDescription, EveryDeclaredOpIsDescribedAndReachableThroughTheAbi) {
  int ops = 0;
  for (const std::string& name : op_names()) {
    const OpSchema* s = find_op_schema(name);
    ASSERT_NE(s, nullptr) << name;
    if (name.rfind("example_", 0) == 0 || name.rfind("modes_test", 0) == 0) continue;  // declared by tests
    ++ops;
    EXPECT_LE(s->abi_minor, uint32_t(LOOM_ABI_VERSION_MINOR)) << name;
    EXPECT_TRUE(s->register_erased) << name;
    EXPECT_FALSE(s->tensors.empty()) << name;
    for (const auto& t : s->tensors) EXPECT_FALSE(t.name.empty()) << name;
  }
  EXPECT_GE(ops, 84);
}

TEST(OpDescription, GemmIsTensorsAndAttributesLikeAnyOp) {
  const OpSchema* s = find_op_schema("gemm");
  ASSERT_NE(s, nullptr);
  std::vector<std::string> names;
  for (const auto& t : s->tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "bias", "c", "pre_gelu", "bias_grad"}));
  // A problem becomes views and attributes and back, pointer for pointer.
  std::vector<float> a(3 * 7), b(7 * 4), c(12);
  GemmParams p;
  p.trans_a = true, p.m = 3, p.n = 4, p.k = 7, p.a = a.data(), p.lda = 7, p.b = b.data(), p.ldb = 7;
  p.c = c.data(), p.ldc = 3, p.alpha = 0.5, p.beta = 1;
  CallArgs args;
  ArgTraits<GemmParams>::gather(p, args);
  ASSERT_EQ(args.slots.size(), 6u);
  EXPECT_EQ(args.slots[0].tensor.shape(), (Shape{1, 7, 3}));  // A as stored: k x m, column-major
  EXPECT_EQ(args.slots[0].tensor.strides(), (Shape{0, 1, 7}));
  EXPECT_FALSE(args.slots[2].tensor.defined());  // no bias
  size_t next = 0;
  GemmParams q = ArgTraits<GemmParams>::build(args, next);
  EXPECT_EQ(q.a, p.a);
  EXPECT_EQ(q.c, p.c);
  EXPECT_EQ(q.m, 3);
  EXPECT_EQ(q.n, 4);
  EXPECT_EQ(q.k, 7);
  EXPECT_EQ(q.lda, 7);
  EXPECT_EQ(q.ldc, 3);
  EXPECT_TRUE(q.trans_a);
  EXPECT_EQ(q.beta, 1.0);
}

TEST(OpDescription, ADescriptionThatDisagreesWithItsSignatureIsAnError) {
  std::vector<std::pair<std::string, AttrValue>> fields{{"eps", AttrValue::of_float(1e-5)}};
  OpSchema bad = OpSchema().in("x", "N").in("y", "N");  // the signature passes one input and one output
  bad.name = "bad_op";
  test::expect_error_mentioning([&] { detail::check_schema(bad, {true, false}, fields); },
                                {"bad_op", "'y' is an input", "Tensor&"});
  OpSchema extra = OpSchema().in("x", "N").out("out", "N").attr("alpha", {1.0});
  extra.name = "extra_attr";
  test::expect_error_mentioning([&] { detail::check_schema(extra, {true, false}, fields); },
                                {"extra_attr", "attribute 'alpha'"});
}

}  // namespace
}  // namespace loom
