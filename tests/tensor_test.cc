// Tensor metadata and views: views share storage, contiguous() copies only when needed, factories and printing.
#include "test_util.h"

namespace loom {
namespace {

Tensor iota(const Shape& s, DType dt = kF32) { return arange(numel_of(s), dt).reshape(s); }

TEST(Tensor, FactoriesFillEveryElement) {
  for (DType dt : {kF32, kF64, kBF16, kF16, kI32, kI64, kU8, kBool}) {
    auto z = zeros({3, 5}, dt);
    auto o = ones({3, 5}, dt);
    for (double v : test::values(z)) ASSERT_EQ(v, 0.0) << dtype_name(dt);
    for (double v : test::values(o)) ASSERT_EQ(v, 1.0) << dtype_name(dt);
  }
  auto f = full({2, 2}, 2.5, kBF16);
  EXPECT_EQ(f.select(0, 1).select(0, 1).item<float>(), 2.5f);
}

TEST(Tensor, ItemRequiresOneElement) {
  EXPECT_THROW(zeros({2}).item<float>(), Error);
  EXPECT_EQ(full({1, 1}, 7, kI32).item<int64_t>(), 7);
}

TEST(Tensor, ArangeAndFromVector) {
  EXPECT_EQ(test::values(arange(5)), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(test::values(arange(1.0, 2.0, 0.25, kF64)), (std::vector<double>{1, 1.25, 1.5, 1.75}));
  auto t = from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  EXPECT_EQ(t.dtype(), kI32);
  EXPECT_THROW(from_vector<float>({1, 2, 3}, {2, 2}), Error);
}

TEST(Tensor, ViewsShareStorage) {
  auto t = iota({4, 6});
  auto tr = t.transpose(0, 1);
  auto sl = t.slice(1, 1, 5, 2);
  auto sel = t.select(0, 2);
  auto ex = t.select(1, 0).unsqueeze(1).expand({4, 3});
  for (const Tensor* v : {&tr, &sl, &sel, &ex}) EXPECT_TRUE(v->shares_storage_with(t));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(test::values(sl), (std::vector<double>{1, 3, 7, 9, 13, 15, 19, 21}));
  EXPECT_EQ(test::values(sel), (std::vector<double>{12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(test::values(ex), (std::vector<double>{0, 0, 0, 6, 6, 6, 12, 12, 12, 18, 18, 18}));
  // Writing through a view changes the base.
  sel.copy_from(full({6}, -1.0));
  EXPECT_EQ(test::values(t.select(0, 2)), std::vector<double>(6, -1.0));
}

TEST(Tensor, ContiguousCopiesOnlyWhenNeeded) {
  auto t = iota({3, 4});
  EXPECT_TRUE(t.contiguous().is_same(t));
  auto tr = t.t();
  auto c = tr.contiguous();
  EXPECT_FALSE(c.shares_storage_with(t));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(test::values(c), test::values(tr));
  EXPECT_EQ(test::values(c), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

TEST(Tensor, ReshapeViewsWhenPossibleAndCopiesOtherwise) {
  auto t = iota({2, 3, 4});
  auto r = t.reshape({6, 4});
  EXPECT_TRUE(r.shares_storage_with(t));
  auto r2 = t.reshape({-1});
  EXPECT_EQ(r2.shape(), (Shape{24}));
  auto p = t.permute({2, 0, 1});
  EXPECT_THROW(p.view({24}), Error);
  auto rp = p.reshape({24});
  EXPECT_FALSE(rp.shares_storage_with(t));
  EXPECT_EQ(test::values(rp), test::values(p.contiguous()));
  // A transposed view whose merged dims stay adjacent can be viewed.
  auto s = t.slice(2, 0, 2);  // [2,3,2] strides [12,4,1]
  EXPECT_TRUE(s.reshape({2, 3, 2}).shares_storage_with(t));
  EXPECT_THROW(t.reshape({5, 5}), Error);
  EXPECT_THROW(t.view({-1, -1}), Error);
}

TEST(Tensor, SqueezeUnsqueezeFlattenNarrow) {
  auto t = iota({1, 3, 1, 2});
  EXPECT_EQ(t.squeeze().shape(), (Shape{3, 2}));
  EXPECT_EQ(t.squeeze(2).shape(), (Shape{1, 3, 2}));
  EXPECT_EQ(t.squeeze(1).shape(), t.shape());
  EXPECT_EQ(t.unsqueeze(-1).shape(), (Shape{1, 3, 1, 2, 1}));
  EXPECT_EQ(t.flatten(1).shape(), (Shape{1, 6}));
  EXPECT_EQ(test::values(t.narrow(1, 1, 2)), (std::vector<double>{2, 3, 4, 5}));
  EXPECT_THROW(t.narrow(1, 2, 2), Error);
  EXPECT_THROW(t.select(1, 3), Error);
  EXPECT_THROW(t.transpose(0, 4), Error);
  EXPECT_THROW(t.permute({0, 0, 1, 2}), Error);
  EXPECT_THROW(t.expand({2, 4, 1, 2}), Error);
  EXPECT_EQ(t.expand({2, 3, 5, 2}).stride(2), 0);
}

TEST(Tensor, DtypeConversionAndClone) {
  auto t = from_vector<float>({1.5f, -2.25f, 3.0f}, {3});
  auto i = t.to(kI32);
  EXPECT_EQ(test::values(i), (std::vector<double>{1, -2, 3}));
  auto b = t.to(kBool);
  EXPECT_EQ(test::values(b), (std::vector<double>{1, 1, 1}));
  auto c = t.clone();
  EXPECT_FALSE(c.shares_storage_with(t));
  c.copy_from(zeros({3}));
  EXPECT_EQ(test::values(t)[0], 1.5);
  // Broadcasting copy.
  auto m = zeros({2, 3});
  m.copy_from(t);
  EXPECT_EQ(test::values(m), (std::vector<double>{1.5, -2.25, 3, 1.5, -2.25, 3}));
  EXPECT_THROW(m.copy_from(zeros({4})), Error);
}

TEST(Tensor, StridedCopyBetweenNonContiguousTensors) {
  auto src = test::random_tensor({5, 7, 3}, kF64).permute({2, 0, 1});
  auto dst = zeros({7, 3, 5}, kF32).permute({1, 2, 0});  // shape [3,5,7], non-contiguous
  dst.copy_from(src);
  EXPECT_TRUE(test::all_close(dst, src.to(kF32), 0, 0));
}

TEST(Tensor, RandomIsSeededAndReproducible) {
  Generator g1(42), g2(42), g3(43);
  auto a = randn({1000}, kF32, Device(), &g1);
  auto b = randn({1000}, kF32, Device(), &g2);
  auto c = randn({1000}, kF32, Device(), &g3);
  EXPECT_EQ(test::values(a), test::values(b));
  EXPECT_NE(test::values(a), test::values(c));
  auto a2 = randn({1000}, kF32, Device(), &g1);
  EXPECT_NE(test::values(a), test::values(a2));  // the generator advanced
  // Moments of 100k normals and uniforms.
  auto n = test::values(randn({100000}, kF64, Device(), &g1, 2.0, 3.0));
  double mean = 0, var = 0;
  for (double v : n) mean += v;
  mean /= double(n.size());
  for (double v : n) var += (v - mean) * (v - mean);
  var /= double(n.size());
  EXPECT_NEAR(mean, 2.0, 0.05);
  EXPECT_NEAR(std::sqrt(var), 3.0, 0.05);
  auto u = test::values(rand({100000}, kF32, Device(), &g1, -1.0, 1.0));
  for (double v : u) ASSERT_TRUE(v >= -1.0 && v < 1.0);
  EXPECT_THROW(rand({2}, kI32), Error);
}

TEST(Tensor, PrintingShowsShapeDtypeDeviceAndValues) {
  auto s = from_vector<float>({1, 2, 3, 4}, {2, 2}).str();
  EXPECT_NE(s.find("[[1, 2],\n [3, 4]]"), std::string::npos) << s;
  EXPECT_NE(s.find("shape=[2, 2]"), std::string::npos);
  EXPECT_NE(s.find("dtype=f32"), std::string::npos);
  EXPECT_NE(s.find("device=cpu"), std::string::npos);
  auto big = arange(10000).str();
  EXPECT_NE(big.find("..."), std::string::npos);
}

TEST(Tensor, FromBlobWrapsWithoutCopy) {
  std::vector<float> buf{1, 2, 3, 4, 5, 6};
  bool freed = false;
  {
    auto t = from_blob(buf.data(), {2, 3}, kF32, Device(), [&](void*) { freed = true; });
    EXPECT_EQ(t.data(), buf.data());
    t.select(0, 1).copy_from(zeros({3}));
  }
  EXPECT_TRUE(freed);
  EXPECT_EQ(buf[4], 0.0f);
}

TEST(Tensor, UserErrorsThrowWithContext) {
  try {
    iota({2, 3}).view({4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("view"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[2, 3]"), std::string::npos);
  }
  EXPECT_THROW(empty({-1}), Error);
  EXPECT_THROW(Tensor().shape(), Error);
  EXPECT_THROW(Device::parse("gpu"), Error);
  EXPECT_THROW(Device::parse("cuda:x"), Error);
  EXPECT_EQ(Device::parse("cuda:1").index, 1);
}

}  // namespace
}  // namespace loom
