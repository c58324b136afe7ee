// The conformance suite's coverage: the pairwise covering array holds every pair of parameter values among the
// cases a library accepts (when it declines part of the space), every new parameter class occurs (value classes,
// an output on an input, element offsets, stride 0 and a gemm batch stride of 0, alpha 0, empty and long dims), a
// library kernel registered the way the ABI loader registers one that is wrong in one narrow region fails, native
// passes, and an explicit case (what a replay of a recorded call gives) runs through the same checks.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <set>

#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "providers/conformance.h"
#include "test_util.h"

namespace loom {
namespace {

struct Unregister {
  std::vector<std::string> providers;
  ~Unregister() {
    for (const auto& p : providers) dispatch::unregister_provider(p);
    dispatch::reset_policy();
  }
};

conformance::SuiteOptions options(const std::string& provider, const std::string& op) {
  conformance::SuiteOptions o;
  o.provider = provider;
  o.ops = {op};
  o.dtypes = {kF32};
  return o;
}

// A library kernel for `op` (f32, CPU) that runs native on its arguments after `before` changed them, then lets
// `after` change what it wrote: a wrong kernel in one region.
void register_library(const std::string& op, const std::string& provider, std::function<void(CallArgs&)> before,
                      std::function<void(const CallArgs&)> after = nullptr,
                      OpSchema::ErasedSupports supports = nullptr) {
  const OpSchema* s = find_op_schema(op);
  ASSERT_NE(s, nullptr);
  s->register_erased(
      kCPU, provider, dtypes(kF32), 0,
      [s, before, after](const DeviceContext&, const CallArgs& args) {
        CallArgs c = args;
        if (before) before(c);
        s->run_provider("native", Device(), kF32, c);
        if (after) after(args);
      },
      std::move(supports), "test");
}

const AttrValue* attr(const CallArgs& c, const char* name) { return c.attr(name); }

// Every element of a rank-3 f32 view (none of another rank: the planted mistakes below are made at rank 3 only).
void for_each3(const Tensor& t, const std::function<void(float&, int64_t, int64_t, int64_t)>& f) {
  if (t.dim() != 3) return;
  float* p = static_cast<float*>(const_cast<void*>(t.data()));
  for (int64_t i = 0; i < t.size(0); ++i)
    for (int64_t j = 0; j < t.size(1); ++j)
      for (int64_t k = 0; k < t.size(2); ++k) f(p[i * t.stride(0) + j * t.stride(1) + k * t.stride(2)], i, j, k);
}

bool fails(const std::string& provider, const std::string& op) {
  auto results = conformance::run_suite(options(provider, op));
  EXPECT_FALSE(results.empty());
  return conformance::suite_failed(results);
}

TEST(ConformanceCoverage, EveryPairIsHeldByAcceptedCasesOfALibraryThatDeclinesSome) {
  Unregister u{{"coverage_partial"}};
  // A gemm library for the plain and bias epilogues that also declines alpha -0.5 with a transposed A.
  register_library("gemm", "coverage_partial", nullptr, nullptr, [](const CallArgs& c) {
    const int64_t e = attr(c, "epilogue")->as_int();
    if (e != 0 && e != 1) return false;
    return !(attr(c, "alpha")->as_double() == -0.5 && attr(c, "trans_a")->as_int() == 1);
  });
  auto rows = conformance::suite_coverage(options("coverage_partial", "gemm"));
  ASSERT_EQ(rows.size(), 1u);
  const conformance::Coverage& r = rows[0];
  ASSERT_GT(r.held.size(), 20u);
  // Pairs of values that accepted cases hold, computed here from what each accepted case holds.
  std::set<std::tuple<size_t, int, size_t, int>> held;
  for (const auto& values : r.held)
    for (size_t p = 0; p < values.size(); ++p)
      for (size_t q = p + 1; q < values.size(); ++q)
        if (values[p] >= 0 && values[q] >= 0) held.insert({p, values[p], q, values[q]});
  auto index = [&](const std::string& name) {
    for (size_t p = 0; p < r.params.size(); ++p)
      if (r.params[p].name == name) return p;
    ADD_FAILURE() << "no parameter " << name;
    return size_t(0);
  };
  const size_t epilogue = index("attr epilogue"), alpha = index("attr alpha"), trans_a = index("attr trans_a"),
               beta = index("attr beta"), k = index("dim K"), m = index("dim M"), lda = index("layout a");
  // Every pair of values of these parameters is held by an accepted case, but for the one the library declines and
  // those the op's rule or the size limit never lets occur (listed as excluded).
  const std::set<std::string> excluded(r.excluded_pairs.begin(), r.excluded_pairs.end());
  const std::vector<size_t> main = {alpha, trans_a, beta, k, m, index("dim N"), index("dim Bt"), lda,
                                    index("offset a"), index("offset c"), index("values a")};
  int checked = 0;
  for (size_t x = 0; x < main.size(); ++x)
    for (size_t y = x + 1; y < main.size(); ++y) {
      const size_t p = std::min(main[x], main[y]), q = std::max(main[x], main[y]);
      for (int a = 0; a < int(r.params[p].values.size()); ++a)
        for (int b = 0; b < int(r.params[q].values.size()); ++b) {
          const std::string label = r.params[p].name + "=" + r.params[p].values[size_t(a)] + " with " +
                                    r.params[q].name + "=" + r.params[q].values[size_t(b)];
          const bool declined = label == "attr trans_a=1 with attr alpha=-0.5" ||
                                label == "attr alpha=-0.5 with attr trans_a=1";
          if (label.find("dim K=0") != std::string::npos) continue;  // declined by the wrapper (above)
          if (declined) {
            EXPECT_FALSE(held.count({p, a, q, b})) << label;
            continue;
          }
          if (excluded.count(label)) continue;
          ++checked;
          EXPECT_TRUE(held.count({p, a, q, b})) << label << " is held by no accepted case";
        }
    }
  EXPECT_GT(checked, 500);
  // What the old suite never ran: alpha 0 and beta 0.75 at the long K, M = 1 with a padded A, a batch stride of 0
  // with a transposed A; none of them excluded.
  auto value = [&](size_t p, const std::string& v) {
    const auto& vs = r.params[p].values;
    return int(std::find(vs.begin(), vs.end(), v) - vs.begin());
  };
  auto pair_held = [&](size_t p, const std::string& a, size_t q, const std::string& b) {
    return p < q ? held.count({p, value(p, a), q, value(q, b)}) > 0 : held.count({q, value(q, b), p, value(p, a)}) > 0;
  };
  EXPECT_TRUE(pair_held(alpha, "0", k, "long"));
  EXPECT_TRUE(pair_held(beta, "0.75", k, "long"));
  EXPECT_TRUE(pair_held(m, "1", lda, "padded"));
  EXPECT_TRUE(pair_held(trans_a, "1", lda, "batch_stride0"));
  EXPECT_TRUE(pair_held(epilogue, "1", k, "long"));
  // The declined pair and the epilogues the library does not take are reported, not silently dropped.
  bool reported = false;
  for (const auto& d : r.declined_pairs) reported |= d.find("attr alpha=-0.5") != std::string::npos &&
                                                     d.find("attr trans_a=1") != std::string::npos;
  for (const auto& d : r.declined_pairs) reported |= d.find("attr trans_a=1 with attr alpha=-0.5") != std::string::npos;
  EXPECT_TRUE(reported) << conformance::coverage_table(rows);
  const std::string table = conformance::coverage_table(rows);
  EXPECT_NE(table.find("attr epilogue"), std::string::npos);
  EXPECT_NE(table.find("declined:"), std::string::npos);
  // And the library passes every case it accepts.
  auto results = conformance::run_suite(options("coverage_partial", "gemm"));
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
}

TEST(ConformanceCoverage, EveryNewParameterClassOccurs) {
  auto has = [](const conformance::Coverage& r, const std::string& param, const std::vector<std::string>& values) {
    for (const auto& p : r.params) {
      if (p.name != param) continue;
      for (const auto& v : values) {
        auto it = std::find(p.values.begin(), p.values.end(), v);
        EXPECT_NE(it, p.values.end()) << param << " has no value " << v;
        if (it != p.values.end()) {
          EXPECT_GT(p.cases[size_t(it - p.values.begin())], 0) << param << "=" << v;
        }
      }
      return;
    }
    ADD_FAILURE() << r.op << " has no parameter " << param;
  };
  auto add = conformance::suite_coverage(options("native", "add"));
  ASSERT_EQ(add.size(), 1u);
  has(add[0], "values a", {"normal", "large", "special", "tiny"});
  has(add[0], "alias out", {"none", "on a", "on b"});
  has(add[0], "offset a", {"0", "1", "2", "3", "4", "5", "6", "7"});
  has(add[0], "offset out", {"1", "7"});
  has(add[0], "layout a", {"dense", "strided", "transposed", "stride0"});
  has(add[0], "dim A", {"0", "1", "2..8", "31..257"});
  has(add[0], "dim C", {"rows"});
  EXPECT_TRUE(add[0].declined_pairs.empty());
  auto gemm = conformance::suite_coverage(options("native", "gemm"));
  ASSERT_EQ(gemm.size(), 1u);
  has(gemm[0], "attr alpha", {"1", "-0.5", "0"});
  has(gemm[0], "layout a", {"dense", "padded", "batch_stride0"});
  has(gemm[0], "layout b", {"batch_stride0"});
  has(gemm[0], "offset a", {"3", "7"});
  has(gemm[0], "offset c", {"5"});
  has(gemm[0], "dim K", {"0", "long"});
  has(gemm[0], "values a", {"special", "tiny"});
  auto softmax = conformance::suite_coverage(options("native", "softmax"));
  ASSERT_EQ(softmax.size(), 1u);
  has(softmax[0], "values x", {"logits", "special", "masked"});
  has(softmax[0], "dim C", {"long"});
  auto ce = conformance::suite_coverage(options("native", "cross_entropy_with_grad"));
  ASSERT_EQ(ce.size(), 1u);
  has(ce[0], "alias grad_logits", {"on logits"});
}

TEST(ConformanceCoverage, NativePassesTheNewClasses) {
  for (const char* op : {"add", "softmax", "log_softmax", "gemm", "maximum", "where", "cross_entropy_with_grad"}) {
    auto results = conformance::run_suite(options("native", op));
    EXPECT_FALSE(results.empty()) << op;
    EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  }
}

TEST(ConformanceCoverage, ALibraryWrongInOneRegionFails) {
  Unregister u{{"right", "nan_to_zero", "alias_misread", "unaligned", "softmax_no_max", "batch_stride0",
                "alpha0", "gemv_m1", "beta_long", "last_column_long", "bias_m256", "add_short_at_5"}};
  // The same arguments passed through: passes (no false failure from the erased path).
  register_library("add", "right", nullptr);
  register_library("gemm", "right", nullptr);
  EXPECT_FALSE(fails("right", "add"));
  EXPECT_FALSE(fails("right", "gemm"));

  // add that turns NaN into 0.
  register_library("add", "nan_to_zero", nullptr, [](const CallArgs& c) {
    for_each3(c.slots[2].tensor, [](float& v, int64_t, int64_t, int64_t) { if (std::isnan(v)) v = 0; });
  });
  EXPECT_TRUE(fails("nan_to_zero", "add"));

  // add that writes out = b, then adds a: wrong when out is a's buffer.
  find_op_schema("add")->register_erased(
      kCPU, "alias_misread", dtypes(kF32), 0,
      [](const DeviceContext&, const CallArgs& c) {
        const Tensor &a = c.slots[0].tensor, &b = c.slots[1].tensor, &out = c.slots[2].tensor;
        auto at = [](const Tensor& t, int64_t i, int64_t j, int64_t k) {
          return static_cast<const float*>(t.data())[i * t.stride(0) + j * t.stride(1) + k * t.stride(2)];
        };
        for_each3(out, [&](float& v, int64_t i, int64_t j, int64_t k) { v = at(b, i, j, k); });
        for_each3(out, [&](float& v, int64_t i, int64_t j, int64_t k) { v += at(a, i, j, k); });
      },
      nullptr, "test");
  EXPECT_TRUE(fails("alias_misread", "add"));

  // add that reads a from its buffer's aligned start (the element offset dropped).
  register_library("add", "unaligned", [](CallArgs& c) {
    Tensor& a = c.slots[0].tensor;
    a = a.as_strided(a.shape(), a.strides(), a.storage_offset() - a.storage_offset() % 8);
  });
  EXPECT_TRUE(fails("unaligned", "add"));

  // softmax without the max subtraction.
  find_op_schema("softmax")->register_erased(
      kCPU, "softmax_no_max", dtypes(kF32), 0,
      [](const DeviceContext&, const CallArgs& c) {
        const Tensor& x = c.slots[0].tensor;
        Tensor out = c.slots[1].tensor;
        const int64_t dim = c.attr("dim")->as_int();
        const int64_t n = x.size(dim), inner = x.stride(dim), rows = x.numel() / std::max<int64_t>(1, n);
        const float* xs = static_cast<const float*>(x.data());
        float* o = static_cast<float*>(out.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t base = (r / inner) * inner * n + r % inner;
          float s = 0;
          for (int64_t i = 0; i < n; ++i) s += std::exp(xs[base + i * inner]);
          for (int64_t i = 0; i < n; ++i) o[base + i * inner] = std::exp(xs[base + i * inner]) / s;
        }
      },
      nullptr, "test");
  EXPECT_TRUE(fails("softmax_no_max", "softmax"));

  // gemm that takes a zero batch stride of A or B for one problem: C's later matrices are never written.
  register_library("gemm", "batch_stride0", [](CallArgs& c) {
    if (c.slots[0].tensor.stride(0) != 0 && c.slots[1].tensor.stride(0) != 0) return;
    for (int slot : {0, 1, 3, 4}) {
      Tensor& t = c.slots[size_t(slot)].tensor;
      if (t.defined()) t = t.as_strided({1, t.size(1), t.size(2)}, t.strides(), t.storage_offset());
    }
  });
  EXPECT_TRUE(fails("batch_stride0", "gemm"));

  // gemm that treats alpha 0 as 1.
  register_library("gemm", "alpha0", [](CallArgs& c) {
    for (auto& [n, v] : c.attrs)
      if (n == "alpha" && v.f == 0) v.f = 1;
  });
  EXPECT_TRUE(fails("alpha0", "gemm"));

  // gemm whose m = 1 path assumes a packed A (lda 1).
  register_library("gemm", "gemv_m1", [](CallArgs& c) {
    Tensor& a = c.slots[0].tensor;
    if (attr(c, "trans_a")->as_int() == 0 && a.size(1) == 1 && a.stride(2) > 1)
      a = a.as_strided(a.shape(), {a.stride(0), 1, 1}, a.storage_offset());
  });
  EXPECT_TRUE(fails("gemv_m1", "gemm"));

  // gemm that drops beta past k = 4096.
  register_library("gemm", "beta_long", [](CallArgs& c) {
    const Tensor& a = c.slots[0].tensor;
    const int64_t k = attr(c, "trans_a")->as_int() ? a.size(1) : a.size(2);
    if (k <= 4096) return;
    for (auto& [n, v] : c.attrs)
      if (n == "beta") v.f = 0;
  });
  EXPECT_TRUE(fails("beta_long", "gemm"));

  // gemm whose blocked loop stops one column short at the longest row size (n = 8193): that column gets only
  // beta * C and the bias. The suite meets each size in its plainest accepted case (alpha 1, normal values), not
  // only where alpha 0 hides the product.
  auto old_last_column = std::make_shared<std::vector<float>>();
  register_library(
      "gemm", "last_column_long",
      [old_last_column](CallArgs& c) {
        old_last_column->clear();
        const Tensor& out = c.slots[3].tensor;
        if (out.size(2) != 8193) return;
        for_each3(out, [&](float& v, int64_t, int64_t, int64_t k) {
          if (k == 8192) old_last_column->push_back(v);
        });
      },
      [old_last_column](const CallArgs& c) {
        const Tensor &out = c.slots[3].tensor, &bias = c.slots[2].tensor;
        if (out.size(2) != 8193) return;
        const double beta = attr(c, "beta")->f;
        size_t e = 0;
        for_each3(out, [&](float& v, int64_t, int64_t j, int64_t k) {
          if (k != 8192) return;
          v = beta == 0 ? 0.0f : float(beta) * (*old_last_column)[e];
          if (bias.defined()) v += static_cast<const float*>(bias.data())[j * bias.stride(0)];
          ++e;
        });
      });
  EXPECT_TRUE(fails("last_column_long", "gemm"));

  // gemm that leaves the bias off the last row at m = 256 only. The suite meets each size also in its fullest case
  // (the bias present), not only in the plainest (no epilogue).
  register_library("gemm", "bias_m256", nullptr, [](const CallArgs& c) {
    const Tensor &out = c.slots[3].tensor, &bias = c.slots[2].tensor;
    if (!bias.defined() || out.size(1) != 256) return;
    for_each3(out, [&](float& v, int64_t, int64_t j, int64_t) {
      if (j == 255) v -= static_cast<const float*>(bias.data())[j * bias.stride(0)];
    });
  });
  EXPECT_TRUE(fails("bias_m256", "gemm"));

  // add over the flattened elements, wrong in the last one when there are exactly 5 of them. The
  // suite meets each size of an op that does not accumulate also as a whole element count.
  register_library("add", "add_short_at_5", nullptr, [](const CallArgs& c) {
    const Tensor& out = c.slots[2].tensor;
    if (out.numel() != 5) return;
    for_each3(out, [&](float& v, int64_t i, int64_t j, int64_t k) {
      if (i == out.size(0) - 1 && j == out.size(1) - 1 && k == out.size(2) - 1) v = -v;
    });
  });
  EXPECT_TRUE(fails("add_short_at_5", "add"));
}

TEST(ConformanceCoverage, ALibraryWrongAtAnEdgeOfTheCallsShapesOrValuesFails) {
  Unregister u{{"clamps_targets", "scale_two_skipped", "cat_127", "add_rank8"}};
  // Cross entropy that clamps a target outside [0, classes) into range instead of refusing it.
  register_library("cross_entropy_with_grad", "clamps_targets", [](CallArgs& c) {
    const int64_t vocab = c.slots[0].tensor.size(1), limit = attr(c, "vocab_limit")->as_int();
    const int64_t classes = limit < 0 ? vocab : limit, ignore = attr(c, "ignore_index")->as_int();
    Tensor t = c.slots[1].tensor.clone();
    for (int64_t i = 0; i < t.numel(); ++i) {
      auto fix = [&](auto* p) {
        if (p[i] != ignore) p[i] = std::clamp<std::remove_reference_t<decltype(p[i])>>(p[i], 0, classes - 1);
      };
      if (t.dtype() == kI64) fix(static_cast<int64_t*>(t.data()));
      else fix(static_cast<int32_t*>(t.data()));
    }
    c.slots[1].tensor = t;
  });
  EXPECT_TRUE(fails("clamps_targets", "cross_entropy_with_grad"));

  // A loss-gradient scale that returns early at exactly 2 (a power of two, as loss scales are).
  const OpSchema* scale_grad = find_op_schema("cross_entropy_scale_grad");
  scale_grad->register_erased(
      kCPU, "scale_two_skipped", dtypes(kF32), 0,
      [scale_grad](const DeviceContext&, const CallArgs& c) {
        if (*static_cast<const float*>(c.slots[0].tensor.data()) == 2.0f) return;
        scale_grad->run_provider("native", Device(), kF32, c);
      },
      nullptr, "test");
  EXPECT_TRUE(fails("scale_two_skipped", "cross_entropy_scale_grad"));

  // cat that leaves the last of 127 pieces out (its part of out keeps what was there).
  const OpSchema* cat = find_op_schema("cat");
  cat->register_erased(
      kCPU, "cat_127", dtypes(kF32), 0,
      [cat](const DeviceContext&, const CallArgs& c) {
        CallArgs args = c;
        if (args.slots[0].list.size() == 127) {
          const Tensor& last = args.slots[0].list.back();
          const int64_t d = attr(c, "dim")->as_int(), keep = args.slots[1].tensor.size(d) - last.size(d);
          args.slots[1].tensor = args.slots[1].tensor.narrow(d, 0, keep);
          args.slots[0].list.pop_back();
        }
        cat->run_provider("native", Device(), kF32, args);
      },
      nullptr, "test");
  EXPECT_TRUE(fails("cat_127", "cat"));

  // add whose index arithmetic leaves the eighth dim out of a rank-8 call (its first element negated here).
  register_library("add", "add_rank8", nullptr, [](const CallArgs& c) {
    const Tensor& out = c.slots[2].tensor;
    if (out.dim() == 8 && out.numel() > 0) *static_cast<float*>(const_cast<void*>(out.data())) *= -1.0f;
  });
  EXPECT_TRUE(fails("add_rank8", "add"));
}

TEST(ConformanceCoverage, SampleRunsSomeOfTheSameCasesInTheirOrder) {
  conformance::SuiteOptions all = options("native", "softmax");
  all.dtypes = {kF32};
  conformance::SuiteOptions sampled = all;
  sampled.sample = 5;
  const auto every = conformance::run_suite(all);
  const auto some = conformance::run_suite(sampled);
  ASSERT_GT(every.size(), 50u);
  ASSERT_EQ(some.size(), 5u);
  // The kept cases are cases of the whole run (the same indices, so --case reruns one), in their order.
  std::set<int> indices;
  for (const auto& r : every) indices.insert(r.index);
  for (size_t i = 0; i < some.size(); ++i) {
    EXPECT_TRUE(indices.count(some[i].index)) << some[i].index;
    if (i > 0) EXPECT_LT(some[i - 1].index, some[i].index);
  }
  EXPECT_FALSE(conformance::suite_failed(some));
}

// An explicit case, as a replay of a recorded call gives it: add with out on a's buffer at element offset 3, and
// given values holding NaN and inf.
TEST(ConformanceCoverage, AnExplicitCaseRunsThroughTheSameChecks) {
  conformance::ExplicitCase e;
  e.op = "add";
  e.dtype = kF32;
  conformance::TensorCase a, b, out;
  a.shape = b.shape = out.shape = {1, 2, 3};
  a.offset = out.offset = 3;
  a.given = {1, NAN, INFINITY, -2, 0.5, 3e38};
  b.given = {1, 1, 1, -INFINITY, 2, 3.4e38};
  b.strides = {6, 3, 1};
  out.alias_of = 0;
  e.tensors = {a, b, out};
  conformance::SuiteOptions o;
  auto r = conformance::run_explicit_case(e, o);
  EXPECT_EQ(r.status, conformance::CaseStatus::kPass) << r.detail << "\n" << r.description;
  EXPECT_NE(r.description.find("on a"), std::string::npos) << r.description;
  EXPECT_NE(conformance::describe_case(e).find("offset 3"), std::string::npos);

  Unregister u{{"explicit_wrong"}};
  register_library("add", "explicit_wrong", nullptr, [](const CallArgs& c) {
    for_each3(c.slots[2].tensor, [](float& v, int64_t, int64_t, int64_t) { if (std::isinf(v)) v = 3.4e38f; });
  });
  o.provider = "explicit_wrong";
  r = conformance::run_explicit_case(e, o);
  EXPECT_EQ(r.status, conformance::CaseStatus::kFail) << r.description;
  EXPECT_NE(r.detail.find("inf"), std::string::npos) << r.detail;
}

}  // namespace
}  // namespace loom
