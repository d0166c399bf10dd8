#include "core/tensor.h"

#include <gtest/gtest.h>

#include "core/arena.h"
#include "core/random.h"

namespace k3 {

TEST(Tensor, ViewsShareStorageAndCloneCopies) {
  Tensor t = Tensor::empty({2, 3, 4});  // [B, T, D]
  for (int i = 0; i < 24; ++i) t.f32()[i] = float(i);
  Tensor s = t.slice(1, 1, 3);  // [2, 2, 4]
  EXPECT_EQ(s.shape(), (Shape{2, 2, 4}));
  EXPECT_FALSE(s.is_contiguous());
  Tensor c = s.clone();
  EXPECT_TRUE(c.is_contiguous());
  // element [1, 0, 2] of the slice is [1, 1, 2] of the original = 12 + 4 + 2
  EXPECT_EQ(c.f32()[1 * 8 + 0 * 4 + 2], 18.0f);
  Tensor sel = t.select(0, 1);
  EXPECT_EQ(sel.shape(), (Shape{3, 4}));
  EXPECT_EQ(sel.f32()[0], 12.0f);
  EXPECT_EQ(t.reshape({6, -1}).shape(), (Shape{6, 4}));
  EXPECT_THROW(t.reshape({5, 5}), Error);
}

TEST(Tensor, ConvertsThroughReducedPrecision) {
  Tensor t = Tensor::from_vector({1.0f, -2.5f, 3.140625f, 65504.0f}, {4});
  Tensor b = t.to(DType::BF16).to(DType::F32);
  EXPECT_EQ(b.f32()[1], -2.5f);
  Tensor h = t.to(DType::F16).to(DType::F32);
  EXPECT_EQ(h.f32()[2], 3.140625f);
  EXPECT_EQ(h.f32()[3], 65504.0f);
}

TEST(Tensor, ExpectShapeNamesTheTensor) {
  Tensor t = Tensor::zeros({2, 3});
  EXPECT_NO_THROW(expect_shape(t, {2, -1}, "x"));
  try {
    expect_shape(t, {3, 2}, "weight h.0.attn");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight h.0.attn"), std::string::npos);
  }
}

TEST(Arena, ReusesBlocksAfterReset) {
  Arena a(1 << 12);
  Tensor x = a.alloc({100});
  Tensor y = a.alloc({2000});  // bigger than a block: its own block
  EXPECT_NE(x.raw(), y.raw());
  size_t reserved = a.bytes_reserved();
  a.reset();
  Tensor z = a.alloc({100});
  EXPECT_EQ(z.raw(), x.raw());
  EXPECT_EQ(a.bytes_reserved(), reserved);
}

// discard(n) lands where n draws would, so a stream cut into pieces is the same stream.
TEST(Rng, DiscardSkipsExactlyThatManyDraws) {
  Rng seq(42);
  std::vector<float> whole;
  for (int i = 0; i < 1000; ++i) whole.push_back(seq.normal());
  for (int start : {0, 1, 17, 999}) {
    Rng piece(42);
    piece.discard(2 * uint64_t(start));
    EXPECT_EQ(piece.normal(), whole[size_t(start)]) << start;
  }
  Rng a(7), b(7);
  for (int i = 0; i < 5; ++i) a.next_u64();
  b.discard(5);
  EXPECT_EQ(a.next_u64(), b.next_u64());
}

TEST(Rng, IsDeterministicAndUniform) {
  Rng a(7), b(7);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    float u = a.uniform();
    EXPECT_EQ(u, b.uniform());
    EXPECT_GE(u, 0.0f);
    EXPECT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

}  // namespace k3
