// Parameters cast under autocast (amp::cast_parameter): the values are the f32 parameters' casts as each region
// finds them, parameters of one storage (a flat buffer) are cast by ranges, the ranges the region before asked for,
// and a parameter outside them (every one, in the first region) on its own when asked for.
#include <string>
#include <vector>

#include "loom/amp.h"
#include "loom/core/dispatch.h"
#include "loom/functional.h"
#include "test_util.h"

namespace loom {
namespace {

// Cast kernels (the copy op) run by `f`.
template <typename F>
uint64_t casts_in(F&& f) {
  dispatch::set_op_profiling(true);
  dispatch::reset_op_profile();
  f();
  uint64_t n = 0;
  for (const auto& row : dispatch::op_profile()) n += row.op == "copy" ? row.calls : 0;
  dispatch::set_op_profiling(false);
  return n;
}

// A leaf parameter over elements [start, start + n) of `buffer`'s storage.
Tensor parameter_in(const Tensor& buffer, int64_t start, Shape shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  Tensor p = buffer.narrow(0, start, n).view(shape).detach();
  p.set_requires_grad(true);
  return p;
}

TEST(AmpCast, FlatParametersAreCastByTheRangesTheLastRegionAskedFor) {
  // Three parameters in one buffer; b is larger than the gap across which asked-for ranges merge.
  const int64_t big = (int64_t(1) << 22) + 1000;
  Tensor buffer = test::random_tensor({40 + big + 30}, kF32, -3, 3, test::fresh_seed());
  const Tensor a = parameter_in(buffer, 0, {5, 8}), b = parameter_in(buffer, 40, {big});
  const Tensor c = parameter_in(buffer, 40 + big, {3, 10});
  auto expect_cast = [](const Tensor& got, const Tensor& p, const char* what) {
    EXPECT_EQ(got.dtype(), kBF16) << what;
    EXPECT_EQ(got.shape(), p.shape()) << what;
    EXPECT_TRUE(test::bytes_equal(ops::contiguous(got), ops::to_dtype(p.detach(), kBF16))) << what;
  };
  // Each region: the casts of `asked`, in order, counting the cast kernels they ran; then their values checked.
  auto region_casts = [&](std::vector<const Tensor*> asked, const char* what) {
    std::vector<Tensor> got;
    const uint64_t kernels = casts_in([&] {
      for (const Tensor* p : asked) got.push_back(amp::cast_parameter(*p));
    });
    for (size_t i = 0; i < asked.size(); ++i) expect_cast(got[i], *asked[i], what);
    return kernels;
  };
  {  // no region before: each parameter on its own when first asked for, then a view of that cast
    amp::AutocastGuard bf16(kBF16);
    EXPECT_EQ(region_casts({&a, &c, &a}, "first region"), 2u);
  }
  buffer.narrow(0, 0, 40).copy_from(full({40}, 1.5, kF32));  // the parameters change between regions
  {  // a and c, far apart: a kernel each; b, not asked for before, on its own when asked for
    amp::AutocastGuard bf16(kBF16);
    EXPECT_EQ(region_casts({&a, &c}, "second region"), 2u);
    EXPECT_EQ(to_vector<float>(amp::cast_parameter(a).to(kF32))[0], 1.5f) << "the region casts the values it finds";
    EXPECT_EQ(region_casts({&b}, "b in the second region"), 1u);
  }
  {  // a, b and c were asked for: one range, one kernel
    amp::AutocastGuard bf16(kBF16);
    EXPECT_EQ(region_casts({&c, &b, &a}, "third region"), 1u);
  }
  {  // a region that asks nothing casts nothing, and the next starts afresh
    amp::AutocastGuard bf16(kBF16);
  }
  {
    amp::AutocastGuard bf16(kBF16);
    EXPECT_EQ(region_casts({&a, &b}, "after an empty region"), 2u);
    EXPECT_EQ(region_casts({&a}, "a again"), 0u);
  }
  // A tensor that is not a parameter: a plain cast.
  {
    amp::AutocastGuard bf16(kBF16);
    Tensor plain = buffer.narrow(0, 0, 40);
    expect_cast(amp::cast_parameter(plain), plain, "a tensor that is not a leaf requiring grad");
  }
}

}  // namespace
}  // namespace loom
