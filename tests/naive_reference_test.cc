// The conformance suite's naive oracle (src/providers/naive_reference.h) on values computed by hand, per op family,
// and its backward ops against central differences of its own forwards: a wrong oracle cannot hide behind the
// kernels it judges.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <cmath>
#include <functional>
#include <random>

#include "loom/common/half.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"
#include "providers/conformance.h"
#include "providers/naive_reference.h"

namespace loom {
namespace {

using conformance::naive::Case;
using conformance::naive::Operand;

Operand input(const std::string& name, Shape shape, std::vector<double> values, DType dt = kF64) {
  Operand o;
  o.name = name, o.present = true, o.dtype = dt, o.shape = std::move(shape), o.values = std::move(values);
  return o;
}
Operand output(const std::string& name, Shape shape, DType dt = kF64) {
  Operand o;
  o.name = name, o.present = true, o.written = true, o.dtype = dt, o.shape = std::move(shape);
  return o;
}
Operand absent(const std::string& name) {
  Operand o;
  o.name = name;
  return o;
}
AttrValue i(int64_t v) { return AttrValue::of_int(v); }
AttrValue f(double v) { return AttrValue::of_float(v); }
AttrValue f_(double v) { return AttrValue::of_float(v); }  // where a Case named f hides f

// Runs op on c and returns it (the test fails when the oracle has no value).
Case run(const std::string& op, Case c) {
  EXPECT_TRUE(conformance::naive::evaluate(op, c)) << op << ": " << c.no_value;
  return c;
}
const std::vector<double>& out(const Case& c, const std::string& name) {
  for (const auto& t : c.tensors)
    if (t.name == name) return t.values;
  ADD_FAILURE() << "no output " << name;
  static std::vector<double> none;
  return none;
}
void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-12) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < got.size(); ++e) EXPECT_NEAR(got[e], want[e], tol) << "element " << e;
}

TEST(NaiveReference, CoversEveryDeclaredOp) {
  for (const OpSchema* s : op_schemas()) {
    if (s->name.rfind("example_", 0) == 0 || s->name.find("test") != std::string::npos) continue;  // tests' ops
    EXPECT_EQ(conformance::naive::missing_reason(s->name), "") << s->name;
  }
}

TEST(NaiveReference, Elementwise) {
  const double l3 = std::log(3.0);
  auto unary = [](const std::string& op, double x) {
    Case c;
    c.tensors = {input("x", {1}, {x}), output("out", {1})};
    return out(run(op, c), "out")[0];
  };
  EXPECT_NEAR(unary("gelu", 1.0), 0.8411919906082768, 1e-15);  // 0.5 (1 + tanh(sqrt(2/pi) 1.044715))
  EXPECT_NEAR(unary("gelu", -2.0), -0.04540230591222494, 1e-15);
  EXPECT_NEAR(unary("silu", 1.0), 0.7310585786300049, 1e-15);  // 1 / (1 + e^-1)
  EXPECT_NEAR(unary("sigmoid", l3), 0.75, 1e-15);
  EXPECT_NEAR(unary("rsqrt", 4.0), 0.5, 0);
  EXPECT_EQ(unary("relu", -3.0), 0.0);
  EXPECT_TRUE(std::isnan(unary("relu", NAN)));  // as PyTorch: NaN propagates
  auto backward = [](const std::string& op, double g, double saved) {
    Case c;
    c.tensors = {input("grad", {1}, {g}), input("saved", {1}, {saved}), output("grad_x", {1})};
    return out(run(op, c), "grad_x")[0];
  };
  EXPECT_NEAR(backward("gelu_backward", 2.0, 1.0), 2 * 1.0829640837983767, 1e-9);
  EXPECT_NEAR(backward("tanh_backward", 2.0, 0.5), 1.5, 1e-15);     // saved is tanh's output: 2 (1 - 0.25)
  EXPECT_NEAR(backward("sigmoid_backward", 2.0, 0.5), 0.5, 1e-15);  // 2 * 0.5 * 0.5
  EXPECT_EQ(backward("relu_backward", 2.0, -1.0), 0.0);
  EXPECT_EQ(backward("gelu_backward", 2.0, 3e300), 2.0);  // saturated: the limit, not 0 * inf
  EXPECT_EQ(backward("gelu_backward", 2.0, -INFINITY), 0.0);
  // Binary ops with NaN, and an integer result that wraps to its dtype.
  Case m;
  m.tensors = {input("a", {3}, {1, NAN, -2}), input("b", {3}, {2, 0, -3}), output("out", {3})};
  Case mx = run("maximum", m);
  EXPECT_EQ(out(mx, "out")[0], 2);
  EXPECT_TRUE(std::isnan(out(mx, "out")[1]));
  EXPECT_EQ(out(mx, "out")[2], -2);
  Case u;
  u.tensors = {input("a", {2}, {0, 1}, kU8), input("b", {2}, {2, 1}, kU8), output("out", {2}, kU8)};
  expect_near(out(run("sub", u), "out"), {254, 0});  // 0 - 2 in u8
  Case s;
  s.tensors = {input("x", {2}, {3, -4}, kI32), output("out", {2}, kI32)};
  s.attrs = {{"value", f(-1.5)}};  // an integer op's scalar is int64: -1
  expect_near(out(run("mul_scalar", s), "out"), {-3, 4});
  Case w;
  w.tensors = {input("cond", {2}, {1, 0}, kBool), input("a", {2}, {5, 6}), input("b", {2}, {7, 8}), output("out", {2})};
  expect_near(out(run("where", w), "out"), {5, 8});
}

TEST(NaiveReference, Softmax) {
  const double l3 = std::log(3.0);
  Case c;
  c.tensors = {input("x", {1, 1, 2}, {0, l3}), output("out", {1, 1, 2})};
  c.attrs = {{"dim", i(2)}};
  expect_near(out(run("softmax", c), "out"), {0.25, 0.75}, 1e-15);
  expect_near(out(run("log_softmax", c), "out"), {std::log(0.25), std::log(0.75)}, 1e-15);
  // Along dim 1 of [1, 2, 2]: columns are the rows.
  Case d;
  d.tensors = {input("x", {1, 2, 2}, {0, 5, l3, 5}), output("out", {1, 2, 2})};
  d.attrs = {{"dim", i(1)}};
  expect_near(out(run("softmax", d), "out"), {0.25, 0.5, 0.75, 0.5}, 1e-15);
  // A row holding +inf, and a fully masked row (all -inf), are NaN throughout; a -inf element elsewhere gives 0.
  Case n;
  n.tensors = {input("x", {1, 3, 2}, {INFINITY, 0, -INFINITY, -INFINITY, -INFINITY, 0}), output("out", {1, 3, 2})};
  n.attrs = {{"dim", i(2)}};
  Case nr = run("softmax", n);
  for (int e = 0; e < 4; ++e) EXPECT_TRUE(std::isnan(out(nr, "out")[size_t(e)])) << e;
  EXPECT_EQ(out(nr, "out")[4], 0.0);
  EXPECT_EQ(out(nr, "out")[5], 1.0);
  EXPECT_EQ(out(run("log_softmax", n), "out")[4], -INFINITY);
}

TEST(NaiveReference, GemmTransposesAlphaBetaAndEpilogues) {
  // op(A) = A^T with A stored [1, K=2, M=2] = [[1, 2], [3, 4]], so op(A) = [[1, 3], [2, 4]]; B [1, K=2, N=2] =
  // [[5, 6], [7, 8]]; op(A) B = [[26, 30], [38, 44]]; C = 0.5 * that + 2 * [[1, 1], [1, -1]] = [[15, 17], [21, 20]].
  Case c;
  c.tensors = {input("a", {1, 2, 2}, {1, 2, 3, 4}), input("b", {1, 2, 2}, {5, 6, 7, 8}), absent("bias"),
               input("c", {1, 2, 2}, {1, 1, 1, -1}), absent("pre_gelu"), absent("bias_grad")};
  c.tensors[3].written = true;
  c.attrs = {{"trans_a", i(1)}, {"trans_b", i(0)}, {"alpha", f(0.5)}, {"beta", f(2)}, {"epilogue", i(0)}};
  expect_near(out(run("gemm", c), "c"), {15, 17, 21, 20});
  // trans_b: B stored [1, N=2, K=2] = [[5, 7], [6, 8]] is the same op(B); beta 0 ignores C's NaN; bias per row.
  Case b = c;
  b.tensors[1].values = {5, 7, 6, 8};
  b.tensors[2] = input("bias", {2}, {100, 200});
  b.tensors[3].values = {NAN, NAN, NAN, NAN};
  b.attrs = {{"trans_a", i(1)}, {"trans_b", i(1)}, {"alpha", f(1)}, {"beta", f(0)}, {"epilogue", i(1)}};
  expect_near(out(run("gemm", b), "c"), {126, 130, 238, 244});
  // Epilogue 4: C = op(A) op(B) and bias_grad[j] = sum over k of op(B)[k, j] = [5 + 7, 6 + 8].
  Case g = b;
  g.tensors[2] = absent("bias");
  g.tensors[5] = output("bias_grad", {2});
  g.attrs[4] = {"epilogue", i(4)};
  Case gr = run("gemm", g);
  expect_near(out(gr, "c"), {26, 30, 38, 44});
  expect_near(out(gr, "bias_grad"), {12, 14});
  // Epilogue 3 writes pre_gelu = C + bias and C = gelu(pre); epilogue 5 multiplies by gelu'(pre_gelu).
  Case e = b;
  e.tensors[1].values = {0, 0, 0, 0};
  e.tensors[2] = input("bias", {2}, {1, -2});
  e.tensors[4] = output("pre_gelu", {1, 2, 2});
  e.attrs[4] = {"epilogue", i(3)};
  Case er = run("gemm", e);
  expect_near(out(er, "pre_gelu"), {1, 1, -2, -2});
  expect_near(out(er, "c"), {0.8411919906082768, 0.8411919906082768, -0.04540230591222494, -0.04540230591222494});
  Case d = c;
  d.tensors[4] = input("pre_gelu", {1, 2, 2}, {1, 1, 1, 1});
  d.tensors[4].written = true;  // read in place
  d.attrs = {{"trans_a", i(1)}, {"trans_b", i(0)}, {"alpha", f(1)}, {"beta", f(0)}, {"epilogue", i(5)}};
  Case dr = run("gemm", d);
  expect_near(out(dr, "c"), {26 * 1.0829640837983767, 30 * 1.0829640837983767, 38 * 1.0829640837983767,
                             44 * 1.0829640837983767}, 1e-7);
  expect_near(out(dr, "pre_gelu"), {1, 1, 1, 1});
}

TEST(NaiveReference, CrossEntropy) {
  // Rows [0, ln 3] with target 1 (loss -ln 0.75) and target 0 (-ln 0.25); the third row ignored.
  const double l3 = std::log(3.0);
  Case c;
  c.tensors = {input("logits", {3, 2}, {0, l3, 0, l3, 9, 9}), input("targets", {3}, {1, 0, -100}, kI64),
               output("loss", {})};
  c.attrs = {{"ignore_index", i(-100)}, {"reduction", i(0)}, {"vocab_limit", i(-1)}};
  const double l1 = -std::log(0.75), l0 = -std::log(0.25);
  expect_near(out(run("cross_entropy", c), "loss"), {(l1 + l0) / 2});
  c.attrs[1] = {"reduction", i(1)};
  expect_near(out(run("cross_entropy", c), "loss"), {l1 + l0});
  Case none = c;
  none.tensors[2] = output("loss", {3});
  none.attrs[1] = {"reduction", i(2)};
  expect_near(out(run("cross_entropy", none), "loss"), {l1, l0, 0});
  // vocab_limit 2 of 3 columns: the third column takes no part; its gradient is zero.
  Case v;
  v.tensors = {input("logits", {1, 3}, {0, l3, 50}), input("targets", {1}, {1}, kI32), output("loss", {}),
               output("grad_logits", {1, 3})};
  v.attrs = {{"ignore_index", i(-100)}, {"reduction", i(0)}, {"vocab_limit", i(2)}};
  Case vr = run("cross_entropy_with_grad", v);
  expect_near(out(vr, "loss"), {l1});
  expect_near(out(vr, "grad_logits"), {0.25, -0.25, 0});
  // Every target ignored under mean: NaN.
  Case all = c;
  all.tensors[1].values = {-100, -100, -100};
  all.attrs[1] = {"reduction", i(0)};
  EXPECT_TRUE(std::isnan(out(run("cross_entropy", all), "loss")[0]));
  // The backward with a loss gradient of 2 under mean: (softmax - onehot) * 2 / 2.
  Case b;
  b.tensors = {input("grad_loss", {}, {2}), input("logits", {3, 2}, {0, l3, 0, l3, 9, 9}),
               input("targets", {3}, {1, 0, -100}, kI64), output("grad_logits", {3, 2})};
  b.attrs = {{"ignore_index", i(-100)}, {"reduction", i(0)}, {"vocab_limit", i(-1)}};
  expect_near(out(run("cross_entropy_backward", b), "grad_logits"), {0.25, -0.25, -0.75, 0.75, 0, 0});
}

TEST(NaiveReference, NormsAttentionRopeOptimizers) {
  Case ln;
  ln.tensors = {input("x", {1, 3}, {1, 2, 3}), input("weight", {3}, {1, 2, 1}), input("bias", {3}, {0, 0, 10}),
                output("out", {1, 3}), output("mean", {1}), output("rstd", {1})};
  ln.attrs = {{"eps", f(0)}};
  Case lr = run("layer_norm", ln);
  const double r = 1 / std::sqrt(2.0 / 3);  // var of [1, 2, 3] is 2/3 (biased)
  expect_near(out(lr, "out"), {-r, 0, 10 + r});
  expect_near(out(lr, "mean"), {2});
  expect_near(out(lr, "rstd"), {r});
  Case rms;
  rms.tensors = {input("x", {1, 2}, {3, 4}), absent("weight"), output("out", {1, 2}), output("rstd", {1})};
  rms.attrs = {{"eps", f(0)}};
  expect_near(out(run("rms_norm", rms), "out"), {3 / std::sqrt(12.5), 4 / std::sqrt(12.5)});
  // residual = x + delta rounded to x's dtype (bf16: 1 + 2^-9 is 1).
  Case res;
  res.tensors = {input("x", {1, 2}, {1, -1}, kBF16), input("delta", {1, 2}, {1.0 / 512, 0}, kBF16), absent("weight"),
                 absent("bias"), output("residual", {1, 2}, kBF16), output("out", {1, 2}, kBF16), output("mean", {1}, kF32),
                 output("rstd", {1}, kF32)};
  res.attrs = {{"eps", f(0)}};
  Case rr = run("residual_layer_norm", res);
  expect_near(out(rr, "residual"), {1, -1});
  expect_near(out(rr, "out"), {1, -1});
  // One query, two keys at scores 0 and ln 3: probabilities 1/4 and 3/4; lse = ln 4. Causal with T = 1 sees both.
  const double l3 = std::log(3.0);
  Case at;
  at.tensors = {input("q", {1, 1, 1, 1}, {1}), input("k", {1, 1, 2, 1}, {0, l3}), input("v", {1, 1, 2, 1}, {4, 8}),
                output("out", {1, 1, 1, 1}), output("lse", {1, 1, 1})};
  at.attrs = {{"causal", i(1)}, {"scale", f(1)}};
  Case ar = run("scaled_dot_product_attention", at);
  expect_near(out(ar, "out"), {7});
  expect_near(out(ar, "lse"), {std::log(4.0)});
  // Causal with T = S = 2: the first query sees only the first key.
  Case ca;
  ca.tensors = {input("q", {1, 1, 2, 1}, {1, 1}), input("k", {1, 1, 2, 1}, {0, l3}), input("v", {1, 1, 2, 1}, {4, 8}),
                output("out", {1, 1, 2, 1}), output("lse", {1, 1, 2})};
  ca.attrs = {{"causal", i(1)}, {"scale", f(1)}};
  expect_near(out(run("scaled_dot_product_attention", ca), "out"), {4, 7});
  // Rope by a quarter turn: (1, 0) -> (0, 1); inverse -> (0, -1).
  Case ro;
  ro.tensors = {input("x", {1, 1, 1, 2}, {1, 0}), input("cos", {1, 1}, {0}, kF32), input("sin", {1, 1}, {1}, kF32),
                output("out", {1, 1, 1, 2})};
  ro.attrs = {{"inverse", i(0)}};
  expect_near(out(run("rope", ro), "out"), {0, 1});
  ro.attrs = {{"inverse", i(1)}};
  expect_near(out(run("rope", ro), "out"), {0, -1});
  // AdamW's first step moves by lr * g / (|g| + eps) after the decay: 1 * (1 - 0.1 * 0.5) - 0.1 * 2 / (2 + 1e-8).
  Case ad;
  ad.tensors = {input("param", {1}, {1}), input("grad", {1}, {2}), input("exp_avg", {1}, {0}),
                input("exp_avg_sq", {1}, {0})};
  for (int k : {0, 2, 3}) ad.tensors[size_t(k)].written = true;
  ad.attrs = {{"lr", f(0.1)}, {"beta1", f(0.9)}, {"beta2", f(0.999)}, {"eps", f(1e-8)}, {"weight_decay", f(0.5)},
              {"step", i(1)}};
  Case adr = run("adamw_update", ad);
  expect_near(out(adr, "param"), {0.95 - 0.1 * 2 / (2 + 1e-8)}, 1e-15);
  expect_near(out(adr, "exp_avg"), {0.2}, 1e-15);
  expect_near(out(adr, "exp_avg_sq"), {0.004}, 1e-15);
  // SGD with momentum after the first step: buf = 0.9 * 1 + (2 + 0.1 * 1), param = 1 - 0.5 * 3.
  Case sg;
  sg.tensors = {input("param", {1}, {1}), input("grad", {1}, {2}), input("momentum_buffer", {1}, {1}, kF32)};
  sg.tensors[0].written = sg.tensors[2].written = true;
  sg.attrs = {{"lr", f(0.5)}, {"momentum", f(0.9)}, {"weight_decay", f(0.1)}, {"first_step", i(0)}};
  Case sgr = run("sgd_update", sg);
  expect_near(out(sgr, "momentum_buffer"), {3});
  expect_near(out(sgr, "param"), {-0.5});
}

TEST(NaiveReference, ReductionsAndIndexing) {
  Case c;  // x [1, 2, 3] = [[1, 5, 5], [NaN, 2, 7]]
  c.tensors = {input("x", {1, 2, 3}, {1, 5, 5, NAN, 2, 7}), output("out", {2})};
  c.attrs = {{"dims", AttrValue::of_ints({2})}, {"keepdim", i(0)}};
  Case am = run("argmax", c);
  expect_near(out(am, "out"), {1, 0});  // the first maximum on ties; NaN wins
  Case mx = run("max", c);
  EXPECT_EQ(out(mx, "out")[0], 5);
  EXPECT_TRUE(std::isnan(out(mx, "out")[1]));
  Case s;
  s.tensors = {input("x", {2, 1, 2}, {1, 2, 3, 4}), output("out", {2})};
  s.attrs = {{"dims", AttrValue::of_ints({0, 1})}, {"keepdim", i(0)}};
  expect_near(out(run("sum", s), "out"), {4, 6});
  expect_near(out(run("mean", s), "out"), {2, 3});
  expect_near(out(run("norm", s), "out"), {std::sqrt(10.0), std::sqrt(20.0)});
  // cat along dim 2 of [1, 1, 1] and [1, 1, 2]; gather; scatter_add with a repeated index.
  Case ct;
  ct.tensors = {absent("inputs"), output("out", {1, 1, 3})};
  ct.tensors[0].present = true;
  ct.list = {input("inputs", {1, 1, 1}, {7}), input("inputs", {1, 1, 2}, {8, 9})};
  ct.attrs = {{"dim", i(2)}};
  expect_near(out(run("cat", ct), "out"), {7, 8, 9});
  Case g;
  g.tensors = {input("x", {1, 2, 3}, {10, 11, 12, 20, 21, 22}), input("index", {1, 2, 2}, {2, 0, 1, 1}, kI64),
               output("out", {1, 2, 2})};
  g.attrs = {{"dim", i(2)}};
  expect_near(out(run("gather", g), "out"), {12, 10, 21, 21});
  Case sa;
  sa.tensors = {input("index", {1, 1, 3}, {1, 1, 0}, kI64), input("src", {1, 1, 3}, {1, 2, 4}),
                input("out", {1, 1, 2}, {100, 200})};
  sa.tensors[2].written = true;
  sa.attrs = {{"dim", i(2)}};
  expect_near(out(run("scatter_add", sa), "out"), {104, 203});
  Case tr;
  tr.tensors = {input("x", {1, 2, 2}, {1, 2, 3, 4}), output("out", {1, 2, 2})};
  tr.attrs = {{"diagonal", i(0)}, {"upper", i(0)}};
  expect_near(out(run("triangular", tr), "out"), {1, 0, 3, 4});
}

TEST(NaiveReference, PhiloxKnownAnswersAndDropout) {
  // Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
  auto block = [](std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
    std::array<uint32_t, 4> r{};
    conformance::naive::philox4x32_10(ctr.data(), key.data(), r.data());
    return r;
  };
  EXPECT_EQ(block({0, 0, 0, 0}, {0, 0}), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(block({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(block({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  // Dropout keeps element i when draw i >= p and scales it by 1 / (1 - p).
  Case d;
  d.tensors = {input("x", {1, 8}, {1, 1, 1, 1, 1, 1, 1, 1}), output("out", {1, 8})};
  d.attrs = {{"p", f(0.5)}, {"seed", i(7)}, {"offset", i(3)}};
  Case dr = run("dropout", d);
  for (size_t e = 0; e < 8; ++e)
    EXPECT_EQ(out(dr, "out")[e], conformance::naive::philox_uniform_draw(7, 3, e) >= 0.5 ? 2.0 : 0.0);
  EXPECT_EQ(conformance::naive::philox_uniform_draw(0, 0, 1), double(0xe169c58du >> 8) / 16777216.0);
  EXPECT_EQ(conformance::naive::philox_uniform_draw(0, 1, 4), conformance::naive::philox_uniform_draw(0, 2, 0));
  Case n;  // a normal draw has no naive value
  n.tensors = {output("out", {1, 2})};
  n.attrs = {{"distribution", i(1)}};
  EXPECT_FALSE(conformance::naive::evaluate("random", n));
  EXPECT_FALSE(n.no_value.empty());
}

// A backward op against central differences of its forward: <grad, f(x + h e)> - <grad, f(x - h e)> over 2h.
void check_gradient(const std::string& forward, const std::string& backward, Case fwd, const std::string& x_name,
                    const std::string& y_name, const std::function<Case(const Case& fwd, const std::vector<double>& grad)>& make_backward,
                    const std::string& grad_name) {
  std::mt19937_64 eng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  Case y0 = run(forward, fwd);
  std::vector<double> grad(out(y0, y_name).size());
  for (auto& g : grad) g = u(eng);
  Case bw = run(backward, make_backward(y0, grad));
  const std::vector<double>& analytic = out(bw, grad_name);
  size_t xi = 0;
  while (fwd.tensors[xi].name != x_name) ++xi;
  for (size_t e = 0; e < fwd.tensors[xi].values.size(); ++e) {
    const double h = 1e-6;
    auto objective = [&](double delta) {
      Case c = fwd;
      c.tensors[xi].values[e] += delta;
      Case r = run(forward, c);
      double s = 0;
      for (size_t k = 0; k < grad.size(); ++k) s += grad[k] * out(r, y_name)[k];
      return s;
    };
    EXPECT_NEAR(analytic.at(e), (objective(h) - objective(-h)) / (2 * h), 1e-6) << backward << " element " << e;
  }
}
std::vector<double> random_values(size_t n, uint64_t seed) {
  std::mt19937_64 eng(seed);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  std::vector<double> v(n);
  for (auto& x : v) x = u(eng);
  return v;
}

TEST(NaiveReference, BackwardsAreTheForwardsDerivatives) {
  for (const char* fn : {"gelu", "silu", "tanh", "sigmoid"}) {
    Case f;
    f.tensors = {input("x", {1, 1, 5}, random_values(5, 1)), output("out", {1, 1, 5})};
    const std::string name = fn;
    const bool saves_output = name == "tanh" || name == "sigmoid";
    check_gradient(name, name + "_backward", f, "x", "out", [&](const Case& y, const std::vector<double>& g) {
      Case b;
      b.tensors = {input("grad", {1, 1, 5}, g), input("saved", {1, 1, 5}, saves_output ? out(y, "out") : y.tensors[0].values),
                   output("grad_x", {1, 1, 5})};
      return b;
    }, "grad_x");
  }
  for (bool log : {false, true}) {
    Case f;
    f.tensors = {input("x", {2, 3, 4}, random_values(24, 2)), output("out", {2, 3, 4})};
    f.attrs = {{"dim", i(1)}};
    const std::string op = log ? "log_softmax" : "softmax";
    check_gradient(op, op + "_backward", f, "x", "out", [&](const Case& y, const std::vector<double>& g) {
      Case b;
      b.tensors = {input("grad", {2, 3, 4}, g), input("out", {2, 3, 4}, out(y, "out")), output("grad_input", {2, 3, 4})};
      b.attrs = {{"dim", i(1)}};
      return b;
    }, "grad_input");
  }
  for (bool centered : {true, false}) {
    Case f;
    f.tensors = {input("x", {3, 5}, random_values(15, 3)), input("weight", {5}, random_values(5, 4)),
                 input("bias", {5}, random_values(5, 5)), output("out", {3, 5}), output("mean", {3}), output("rstd", {3})};
    if (!centered) f.tensors = {f.tensors[0], f.tensors[1], f.tensors[3], f.tensors[5]};
    f.attrs = {{"eps", f_(0.1)}};
    const std::string op = centered ? "layer_norm" : "rms_norm";
    for (const char* wrt : {"x", "weight"})
      check_gradient(op, op + "_backward", f, wrt, "out", [&](const Case& y, const std::vector<double>& g) {
        Case b;
        b.tensors = {input("grad", {3, 5}, g), y.tensors[0], y.tensors[1]};
        if (centered) b.tensors.push_back(input("mean", {3}, out(y, "mean")));
        b.tensors.push_back(input("rstd", {3}, out(y, "rstd")));
        b.tensors.push_back(output("grad_input", {3, 5}));
        b.tensors.push_back(output("grad_weight", {5}));
        if (centered) b.tensors.push_back(output("grad_bias", {5}));
        return b;
      }, std::string(wrt) == "x" ? "grad_input" : "grad_weight");
  }
  {  // attention with GQA (H = 2, Hkv = 1) and causal T = 2 < S = 3, every input
    Case f;
    f.tensors = {input("q", {1, 2, 2, 3}, random_values(12, 6)), input("k", {1, 1, 3, 3}, random_values(9, 7)),
                 input("v", {1, 1, 3, 3}, random_values(9, 8)), output("out", {1, 2, 2, 3}), output("lse", {1, 2, 2})};
    f.attrs = {{"causal", i(1)}, {"scale", f_(0.7)}};
    for (const char* wrt : {"q", "k", "v"})
      check_gradient("scaled_dot_product_attention", "scaled_dot_product_attention_backward", f, wrt, "out",
                     [&](const Case& y, const std::vector<double>& g) {
                       Case b;
                       b.tensors = {input("grad_out", {1, 2, 2, 3}, g), y.tensors[0], y.tensors[1], y.tensors[2],
                                    input("out", {1, 2, 2, 3}, out(y, "out")), input("lse", {1, 2, 2}, out(y, "lse")),
                                    output("grad_q", {1, 2, 2, 3}), output("grad_k", {1, 1, 3, 3}),
                                    output("grad_v", {1, 1, 3, 3})};
                       b.attrs = y.attrs;
                       return b;
                     },
                     std::string("grad_") + wrt);
  }
  {  // cross-entropy under sum, an ignored row and a vocabulary limit
    Case f;
    f.tensors = {input("logits", {3, 4}, random_values(12, 9)), input("targets", {3}, {2, 1, 0}, kI64),
                 output("loss", {})};
    f.attrs = {{"ignore_index", i(1)}, {"reduction", i(1)}, {"vocab_limit", i(3)}};
    check_gradient("cross_entropy", "cross_entropy_backward", f, "logits", "loss",
                   [&](const Case& y, const std::vector<double>& g) {
                     Case b;
                     b.tensors = {input("grad_loss", {}, g), y.tensors[0], y.tensors[1], output("grad_logits", {3, 4})};
                     b.attrs = y.attrs;
                     return b;
                   },
                   "grad_logits");
  }
}

// ---- The oracle as a provider: its values written into the call's tensors, so that the stored PyTorch cases (their
// layouts, strides and dtypes) check the oracle against PyTorch's float64 results through the suite's own runner.
double read_element(const Tensor& t, int64_t p) {
  const char* base = static_cast<const char*>(t.data()) + p * int64_t(dtype_size(t.dtype()));
  switch (t.dtype()) {
    case kF32: { float v; std::memcpy(&v, base, 4); return v; }
    case kF64: { double v; std::memcpy(&v, base, 8); return v; }
    case kBF16: { BFloat16 v; std::memcpy(&v.bits, base, 2); return float(v); }
    case kF16: { Half v; std::memcpy(&v.bits, base, 2); return float(v); }
    case kI32: { int32_t v; std::memcpy(&v, base, 4); return v; }
    case kI64: { int64_t v; std::memcpy(&v, base, 8); return double(v); }
    case kI8: { int8_t v; std::memcpy(&v, base, 1); return v; }
    case kU8: case kBool: { uint8_t v; std::memcpy(&v, base, 1); return v; }
  }
  return 0;
}
void write_element(Tensor& t, int64_t p, double x) {
  char* base = static_cast<char*>(t.data()) + p * int64_t(dtype_size(t.dtype()));
  x = conformance::naive::convert(x, t.dtype());
  switch (t.dtype()) {
    case kF32: { float v = float(x); std::memcpy(base, &v, 4); break; }
    case kF64: std::memcpy(base, &x, 8); break;
    case kBF16: { BFloat16 v = BFloat16(float(x)); std::memcpy(base, &v.bits, 2); break; }
    case kF16: { Half v = Half(float(x)); std::memcpy(base, &v.bits, 2); break; }
    case kI32: { int32_t v = int32_t(x); std::memcpy(base, &v, 4); break; }
    case kI64: { int64_t v = int64_t(x); std::memcpy(base, &v, 8); break; }
    case kI8: { int8_t v = int8_t(x); std::memcpy(base, &v, 1); break; }
    case kU8: case kBool: { uint8_t v = uint8_t(x); std::memcpy(base, &v, 1); break; }
  }
}
// Element offsets of a view, row-major over its shape.
std::vector<int64_t> offsets(const Tensor& t) {
  std::vector<int64_t> out;
  std::vector<int64_t> idx(size_t(t.dim()), 0);
  for (int64_t e = 0; e < t.numel(); ++e) {
    int64_t p = 0;
    for (int64_t d = 0; d < t.dim(); ++d) p += idx[size_t(d)] * t.stride(d);
    out.push_back(p);
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < t.size(d)) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}
conformance::naive::Operand operand_of(const Tensor& t, const TensorSpec& spec, bool read) {
  Operand o;
  o.name = spec.name, o.present = t.defined(), o.written = t.defined() && !is_input(spec.role);
  if (!t.defined()) return o;
  o.dtype = t.dtype(), o.shape = t.shape();
  if (read)
    for (int64_t p : offsets(t)) o.values.push_back(read_element(t, p));
  return o;
}
void register_oracle(const std::string& provider) {
  for (const std::string& op : conformance::naive::covered_ops()) {
    const OpSchema* s = find_op_schema(op);
    if (!s) continue;
    s->register_erased(
        kCPU, provider, dtypes(kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool), 0,
        [s](const DeviceContext&, const CallArgs& args) {
          Case c;
          c.attrs = args.attrs;
          const bool dgelu = s->name == "gemm" && args.attr("epilogue") && args.attr("epilogue")->as_int() == 5;
          for (size_t i = 0; i < s->tensors.size(); ++i) {
            const TensorSpec& spec = s->tensors[i];
            if (spec.list) {
              c.tensors.push_back(operand_of(Tensor(), spec, false));
              c.tensors.back().present = true;
              for (const Tensor& t : args.slots[i].list) c.list.push_back(operand_of(t, spec, true));
              continue;
            }
            const bool read = is_input(spec.role) || spec.role == ArgRole::kInPlace || (dgelu && spec.name == "pre_gelu");
            c.tensors.push_back(operand_of(args.slots[i].tensor, spec, read));
          }
          LOOM_REQUIRE(conformance::naive::evaluate(s->name, c), "the naive oracle has no value: ", c.no_value);
          for (size_t i = 0; i < s->tensors.size(); ++i) {
            if (!c.tensors[i].written || s->tensors[i].list) continue;
            Tensor t = args.slots[i].tensor;
            auto pos = offsets(t);
            for (size_t e = 0; e < pos.size(); ++e) write_element(t, pos[e], c.tensors[i].values[e]);
          }
        },
        nullptr, "naive oracle (test)");
  }
}

TEST(NaiveReference, AgreesWithThePyTorchReferences) {
  register_oracle("naive_oracle");
  struct Unregister {
    ~Unregister() { dispatch::unregister_provider("naive_oracle"); }
  } unregister;
  const std::string dir = std::string(LOOM_SOURCE_DIR) + "/conformance/reference";
  conformance::SuiteOptions o;
  o.provider = "naive_oracle";
  size_t checked = 0;
  for (const char* file : {"pytorch_refs.json", "pytorch_sweep.json", "writer_check.json"}) {
    const std::string path = dir + "/" + file;
    if (!std::filesystem::exists(path)) continue;
    auto results = conformance::run_stored(conformance::load_stored_cases(path), o);
    checked += results.size();
    EXPECT_FALSE(conformance::suite_failed(results)) << file << "\n" << conformance::suite_table(results, "");
  }
  EXPECT_GE(checked, 26u);
}

}  // namespace
}  // namespace loom
