// Ops that combine, split and index tensors: cat, split, chunk, stack, index_select, gather, scatter_add, triu and
// tril against references computed element by element, with strided inputs, negative dims and bad arguments.
#include "kernels/shape_kernel.h"
#include "test_util.h"

namespace loom {
namespace {

// Row-major coordinates of flat index i in shape s.
Shape coords_of(int64_t i, const Shape& s) {
  Shape c(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    c[d] = i % s[d];
    i /= s[d];
  }
  return c;
}
int64_t flat_of(const Shape& c, const Shape& s) {
  int64_t i = 0;
  for (size_t d = 0; d < s.size(); ++d) i = i * s[d] + c[d];
  return i;
}

Tensor random_of(const Shape& shape, DType dt) {
  if (is_floating(dt)) return test::random_tensor(shape, dt);
  if (dt == kBool) return test::random_indices(shape, 0, 2).to(kBool);
  return test::random_indices(shape, -50, 50, dt);
}

TEST(Shape, CatAlongEveryDimWithStridedInputs) {
  for (DType dt : {kF32, kF64, kBF16, kI64, kI32, kBool}) {
    for (int64_t dim : {0, 1, 2, -1, -3}) {
      int64_t d = dim < 0 ? dim + 3 : dim;
      std::vector<Tensor> xs;
      for (int64_t size : {2, 1, 3}) {
        Shape s{3, 4, 5};
        s[size_t(d)] = size;
        Tensor x = random_of(s, dt);
        if (size == 1) x = test::make_strided(x);
        if (size == 3) x = random_of({s[2], s[1], s[0]}, dt).permute({2, 1, 0});  // transposed storage
        xs.push_back(x);
      }
      Tensor out = ops::cat(xs, dim);
      Shape expected_shape{3, 4, 5};
      expected_shape[size_t(d)] = 6;
      ASSERT_EQ(out.shape(), expected_shape);
      int64_t offset = 0;
      for (const Tensor& x : xs) {
        EXPECT_EQ(test::values(out.narrow(dim, offset, x.size(d))), test::values(x))
            << dtype_name(dt) << " dim " << dim;
        offset += x.size(d);
      }
    }
  }
  // One input, and an empty one among others.
  Tensor x = test::random_tensor({2, 3});
  EXPECT_EQ(test::values(ops::cat({x}, 0)), test::values(x));
  EXPECT_FALSE(ops::cat({x}, 0).shares_storage_with(x));
  EXPECT_EQ(test::values(ops::cat({x, empty({2, 0})}, 1)), test::values(x));
}

TEST(Shape, CatKernelWritesEveryElement) {
  Tensor a = test::random_tensor({2, 3}), b = test::make_strided(test::random_tensor({2, 4}));
  Tensor out = test::poisoned({2, 7}, kF32);
  dispatch::call(cat_op, out.device(), kF32, std::vector<Tensor>{a, b}, CatAttrs{1}, out);
  EXPECT_EQ(test::values(out.narrow(1, 0, 3)), test::values(a));
  EXPECT_EQ(test::values(out.narrow(1, 3, 4)), test::values(b));
}

TEST(Shape, SplitAndChunkAreViews) {
  Tensor x = test::random_tensor({4, 7});
  auto parts = ops::split(x, 3, -1);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].shape(), (Shape{4, 3}));
  EXPECT_EQ(parts[2].shape(), (Shape{4, 1}));
  for (const Tensor& p : parts) EXPECT_TRUE(p.shares_storage_with(x));
  EXPECT_EQ(test::values(ops::cat(parts, 1)), test::values(x));
  EXPECT_EQ(test::values(parts[1]), test::values(x.slice(1, 3, 6)));

  auto chunks = ops::chunk(x, 3, 1);  // ceil(7 / 3) = 3: sizes 3, 3, 1
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[2].size(1), 1);
  auto fewer = ops::chunk(test::random_tensor({6}), 4, 0);  // ceil(6 / 4) = 2: three chunks of 2
  ASSERT_EQ(fewer.size(), 3u);
  EXPECT_EQ(fewer[2].size(0), 2);
  auto rows = ops::chunk(x, 2, -2);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(test::values(rows[1]), test::values(x.slice(0, 2, 4)));
  EXPECT_THROW(ops::split(x, 0, 0), Error);
  EXPECT_THROW(ops::chunk(x, 0, 0), Error);
  EXPECT_THROW(ops::split(x, 2, 2), Error);
}

TEST(Shape, StackAddsADim) {
  for (int64_t dim : {0, 1, 2, -1}) {
    std::vector<Tensor> xs{test::random_tensor({2, 3}), test::make_strided(test::random_tensor({2, 3})),
                           test::random_tensor({3, 2}).t()};
    Tensor out = ops::stack(xs, dim);
    int64_t d = dim < 0 ? dim + 3 : dim;
    Shape expected{2, 3};
    expected.insert(expected.begin() + d, 3);
    ASSERT_EQ(out.shape(), expected);
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(test::values(out.select(d, i)), test::values(xs[size_t(i)]));
  }
  EXPECT_THROW(ops::stack({test::random_tensor({2, 3}), test::random_tensor({3, 2})}, 0), Error);
  EXPECT_THROW(ops::stack({}, 0), Error);
  EXPECT_THROW(ops::stack({test::random_tensor({2})}, 2), Error);
}

TEST(Shape, IndexSelect) {
  for (DType dt : {kF32, kBF16, kF64, kI32, kBool}) {
    for (DType index_dt : {kI32, kI64}) {
      for (int64_t dim : {0, 1, 2, -1}) {
        Shape xs{4, 5, 3};
        Tensor x = test::make_strided(random_of(xs, dt));
        int64_t d = dim < 0 ? dim + 3 : dim;
        Tensor index = test::random_indices({7}, 0, xs[size_t(d)], index_dt);  // repeats likely
        Tensor out = ops::index_select(x, dim, index);
        Shape os = xs;
        os[size_t(d)] = 7;
        ASSERT_EQ(out.shape(), os);
        auto xv = test::values(x), iv = test::values(index), ov = test::values(out);
        for (int64_t i = 0; i < numel_of(os); ++i) {
          Shape c = coords_of(i, os);
          c[size_t(d)] = int64_t(iv[size_t(c[size_t(d)])]);
          ASSERT_EQ(ov[size_t(i)], xv[size_t(flat_of(c, xs))]) << dtype_name(dt) << " dim " << dim;
        }
      }
    }
  }
  Tensor x = test::random_tensor({3, 4});
  EXPECT_EQ(ops::index_select(x, 1, from_vector<int64_t>({}, {0})).shape(), (Shape{3, 0}));
  EXPECT_THROW(ops::index_select(x, 0, from_vector<int64_t>({0, 3})), Error);
  EXPECT_THROW(ops::index_select(x, 0, from_vector<int32_t>({-1})), Error);
  EXPECT_THROW(ops::index_select(x, 0, from_vector<float>({0})), Error);
  EXPECT_THROW(ops::index_select(x, 0, from_vector<int64_t>({0, 1}, {1, 2})), Error);
  EXPECT_THROW(ops::index_select(x, 2, from_vector<int64_t>({0})), Error);
}

TEST(Shape, Gather) {
  for (DType dt : {kF32, kF64, kBF16, kI64}) {
    for (int64_t dim : {0, 1, -1}) {
      Shape xs{4, 5, 6};
      int64_t d = dim < 0 ? dim + 3 : dim;
      Shape is{3, 4, 2};  // smaller than x in every dim, larger along the gathered one is fine too
      is[size_t(d)] = 9;
      Tensor x = random_of({6, 5, 4}, dt).permute({2, 1, 0});
      Tensor index = test::random_indices(is, 0, xs[size_t(d)], dim == 0 ? kI32 : kI64);
      Tensor out = ops::gather(x, dim, index);
      ASSERT_EQ(out.shape(), is);
      auto xv = test::values(x), iv = test::values(index), ov = test::values(out);
      for (int64_t i = 0; i < numel_of(is); ++i) {
        Shape c = coords_of(i, is);
        c[size_t(d)] = int64_t(iv[size_t(i)]);
        ASSERT_EQ(ov[size_t(i)], xv[size_t(flat_of(c, xs))]) << dtype_name(dt) << " dim " << dim;
      }
    }
  }
  Tensor x = test::random_tensor({3, 4});
  EXPECT_THROW(ops::gather(x, 1, from_vector<int64_t>({0, 4}, {1, 2})), Error);     // out of range
  EXPECT_THROW(ops::gather(x, 1, from_vector<int64_t>({0, 1}, {2})), Error);        // rank
  EXPECT_THROW(ops::gather(x, 1, test::random_indices({4, 1}, 0, 4)), Error);       // larger than x in dim 0
}

TEST(Shape, ScatterAddAccumulatesRepeatedIndices) {
  for (DType dt : {kF32, kF64, kBF16, kI64}) {
    for (int64_t dim : {0, 1, -1}) {
      int64_t d = dim < 0 ? dim + 2 : dim;
      // index may be longer than x along dim, never longer than src.
      Shape xs{5, 4};
      Shape is = d == 0 ? Shape{6, 3} : Shape{4, 6};
      Shape src_shape = d == 0 ? Shape{6, 5} : Shape{4, 7};
      Tensor x = random_of(xs, dt);
      Tensor src = test::make_strided(random_of(src_shape, dt));
      Tensor index = test::random_indices(is, 0, xs[size_t(d)], kI64);
      Tensor out = ops::scatter_add(x, dim, index, src);
      auto expected = test::values(x);
      auto sv = test::values(src), iv = test::values(index);
      for (int64_t i = 0; i < numel_of(is); ++i) {
        Shape c = coords_of(i, is);
        double value = sv[size_t(flat_of(c, src.shape()))];
        c[size_t(d)] = int64_t(iv[size_t(i)]);
        expected[size_t(flat_of(c, xs))] += value;
      }
      double tol = dt == kBF16 ? 0.05 : 1e-5;  // bf16 rounds after each addition
      EXPECT_TRUE(test::all_close(out, from_vector(expected, xs), tol, tol)) << dtype_name(dt) << " dim " << dim;
      EXPECT_FALSE(out.shares_storage_with(x));
    }
  }
  Tensor x = zeros({3, 2});
  EXPECT_THROW(ops::scatter_add(x, 0, from_vector<int64_t>({3}, {1, 1}), ones({1, 1})), Error);
  EXPECT_THROW(ops::scatter_add(x, 0, from_vector<int64_t>({0}, {1, 1}), ones({1, 1}, kF64)), Error);
  EXPECT_THROW(ops::scatter_add(x, 0, from_vector<int64_t>({0, 0}, {1, 2}), ones({1, 1})), Error);
  EXPECT_THROW(ops::scatter_add(x, 0, from_vector<float>({0}, {1, 1}), ones({1, 1})), Error);
}

TEST(Shape, TriuAndTrilOnTheLastTwoDims) {
  for (DType dt : {kF32, kBF16, kI64, kBool}) {
    for (int64_t diagonal : {-2, -1, 0, 1, 3}) {
      Shape xs{2, 4, 5};
      Tensor x = test::make_strided(random_of(xs, dt));
      auto xv = test::values(x), up = test::values(ops::triu(x, diagonal)), low = test::values(ops::tril(x, diagonal));
      for (int64_t i = 0; i < numel_of(xs); ++i) {
        Shape c = coords_of(i, xs);
        int64_t offset = c[2] - c[1];
        ASSERT_EQ(up[size_t(i)], offset >= diagonal ? xv[size_t(i)] : 0.0) << dtype_name(dt) << " " << diagonal;
        ASSERT_EQ(low[size_t(i)], offset <= diagonal ? xv[size_t(i)] : 0.0) << dtype_name(dt) << " " << diagonal;
      }
    }
  }
  EXPECT_EQ(ops::triu(ones({3, 0, 2})).shape(), (Shape{3, 0, 2}));
  EXPECT_THROW(ops::triu(ones({4})), Error);
  EXPECT_THROW(ops::tril(Tensor()), Error);
}

TEST(Shape, CatRejectsMismatches) {
  Tensor a = test::random_tensor({2, 3});
  EXPECT_THROW(ops::cat({}, 0), Error);
  EXPECT_THROW(ops::cat({a, test::random_tensor({3, 3})}, 1), Error);
  EXPECT_THROW(ops::cat({a, test::random_tensor({2, 3, 1})}, 0), Error);
  EXPECT_THROW(ops::cat({a, test::random_tensor({2, 3}, kF64)}, 0), Error);
  EXPECT_THROW(ops::cat({a, a}, 2), Error);
  EXPECT_THROW(ops::cat({full({}, 1.0), full({}, 1.0)}, 0), Error);
  EXPECT_EQ(ops::cat({a, a}, -2).shape(), (Shape{4, 3}));
}

}  // namespace
}  // namespace loom
