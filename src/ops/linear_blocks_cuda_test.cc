// Block-format weights on CUDA (F8B128, MXFP4) against the CPU's product with the same packed
// weight (itself tested against the dequantised weight in linear_blocks_test.cc): the streamed
// decode product within 1e-5 relative L2 (fp32 arithmetic), the bf16 tensor-core form of larger
// batches within 1e-2 (operands rounded to bf16). Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <vector>

#include "ops/ag_cuda_testing.h"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "ops/ops_cuda.h"

namespace k3 {
namespace {

using testing::rand_var;
using testing::rel_diff;

class LinearBlocksCuda : public ::testing::TestWithParam<DType> {};

TEST_P(LinearBlocksCuda, MatchesTheHostProduct) {
  Rng rng(11);
  for (const auto& [in, out] : {std::pair<int64_t, int64_t>{256, 300}, {2304, 1024}, {1024, 2304}}) {
    const Tensor w = rand_var(rng, {out, in}, 0.05f)->value.to(GetParam());
    const Tensor b = rand_var(rng, {out})->value;
    const Tensor wd = w.to_device(Device::CUDA), bd = b.to_device(Device::CUDA);
    for (int64_t M : {int64_t(1), int64_t(2), int64_t(5), cuda::kGemvMaxRows, cuda::kGemvMaxRows + 1, int64_t(64)}) {
      const Tensor x = rand_var(rng, {M, in})->value;
      Tensor want = Tensor::empty({M, out});
      linear_forward(x.f32(), M, in, out, w, WeightLayout::OutIn, b.f32(), want.f32());
      const Tensor y = Tensor::empty_on(Device::CUDA, {M, out});
      linear::forward(x.to_device(Device::CUDA), wd, bd, WeightLayout::OutIn, y, false);
      const double tol = M <= cuda::kGemvMaxRows ? 1e-5 : 1e-2;
      EXPECT_LT(rel_diff(y.to_device(Device::CPU), want), tol) << in << " -> " << out << ", M " << M;
    }
  }
}

TEST_P(LinearBlocksCuda, DequantisesToTheHostValues) {
  Rng rng(12);
  const Tensor w = rand_var(rng, {40, 512})->value.to(GetParam());
  const Tensor wd = w.to_device(Device::CUDA);
  const Tensor out = Tensor::empty_on(Device::CUDA, {40, 512}, DType::BF16);
  cuda::dequantize_to_bf16(w.dtype(), wd.raw(), w.numel(), out.raw());
  const Tensor got = out.to_device(Device::CPU).to(DType::F32), want = w.to(DType::F32).to(DType::BF16).to(DType::F32);
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(got.f32()[i], want.f32()[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Formats, LinearBlocksCuda, ::testing::Values(DType::F8B128, DType::MXFP4),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

}  // namespace
}  // namespace k3
