// The linear layer with block-format weights (F8B128, MXFP4) against a plain loop over the
// dequantised weight: the decode's streamed rows (M ≤ kBlockRowsFused) and the tiled form.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "ops/gemm.h"
#include "ops/linear.h"

namespace k3 {
namespace {

Tensor random_tensor(Shape shape, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.normal();
  return t;
}

class LinearBlocks : public ::testing::TestWithParam<DType> {};

TEST_P(LinearBlocks, MatchesTheDequantisedProduct) {
  const int64_t in = 256, out = 300;  // 300 rows: more than one tile of the batched form
  const Tensor w = random_tensor({out, in}, 1).to(GetParam());
  const Tensor wf = w.to(DType::F32);  // the reference's weight: the same values, inflated
  const Tensor b = random_tensor({out}, 2);
  for (int64_t M : {int64_t(1), int64_t(3), kBlockRowsFused, kBlockRowsFused + 1, int64_t(40)}) {
    const Tensor x = random_tensor({M, in}, 3 + uint64_t(M));
    std::vector<float> y(size_t(M * out), 0.5f);
    linear_forward(x.f32(), M, in, out, w, WeightLayout::OutIn, b.f32(), y.data(), 1.0f);  // beta 1: y += ...
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out; ++o) {
        double want = 0.5 + b.f32()[o];
        for (int64_t i = 0; i < in; ++i) want += double(x.f32()[m * in + i]) * wf.f32()[o * in + i];
        ASSERT_NEAR(y[size_t(m * out + o)], want, 1e-4 * (1 + std::fabs(want))) << "M " << M << " row " << o;
      }
  }
}

TEST_P(LinearBlocks, ThroughTheModuleForwardOnlyAndRefusesAGradient) {
  Linear l(128, 64, Bias::None);
  l.weight->value = random_tensor({64, 128}, 7).to(GetParam());
  const Tensor x = random_tensor({2, 128}, 8);
  const Var y = l(constant(x));
  const Tensor wf = l.weight->value.to(DType::F32);
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t o = 0; o < 64; ++o) {
      double want = 0;
      for (int64_t i = 0; i < 128; ++i) want += double(x.f32()[m * 128 + i]) * wf.f32()[o * 128 + i];
      ASSERT_NEAR(y->value.f32()[m * 64 + o], want, 1e-4 * (1 + std::fabs(want)));
    }
  std::vector<float> dy(2 * 64, 1.0f), dx(2 * 128, 0.0f);
  EXPECT_THROW(linear_backward(x.f32(), dy.data(), 2, 128, 64, l.weight->value, WeightLayout::OutIn, dx.data(), nullptr,
                               nullptr),
               Error);
  EXPECT_THROW(linear_forward(x.f32(), 2, 64, 128, l.weight->value, WeightLayout::InOut, nullptr, dx.data()), Error);
}

INSTANTIATE_TEST_SUITE_P(Formats, LinearBlocks, ::testing::Values(DType::F8B128, DType::MXFP4),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

}  // namespace
}  // namespace k3
