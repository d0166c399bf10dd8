// AttnRes on CUDA against fla's naive_attnres (fixtures/ops/attnres.safetensors), forward and
// every gradient within 1e-4 relative L2, and against the CPU operator on a larger random case
// (many sources, D not a multiple of the block). Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "io/safetensors.h"
#include "ops/ag_cuda_testing.h"
#include "residual/ag_attnres.h"
#include "residual/attnres.h"
#include "residual/attnres_cuda.h"

namespace k3 {
namespace {

using device::Buffer;

Buffer up(const Tensor& t) { return device::upload_values(t.f32(), t.numel(), device::Storage::F32); }
Tensor down(const Buffer& b, const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  device::download_values(t.f32(), b, t.numel(), device::Storage::F32);
  return t;
}
double rel(const Tensor& x, const Tensor& ref) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    num += std::pow(double(x.f32()[i]) - ref.f32()[i], 2);
    den += std::pow(double(ref.f32()[i]), 2);
  }
  return std::sqrt(num / den);
}

struct Result {
  Tensor o, dq, dw;
  std::vector<Tensor> dsrc;
};

Result run_cuda(const std::vector<Tensor>& src, const Tensor& query, const Tensor& rmsw, const Tensor& d_o) {
  const int64_t D = query.numel();
  const AttnResShape s{src[0].numel() / D, D};
  std::vector<Buffer> bufs, dbufs;
  std::vector<const float*> ptrs;
  std::vector<float*> dptrs;
  for (const Tensor& r : src) {
    bufs.push_back(up(r));
    ptrs.push_back(bufs.back().as<float>());
    dbufs.push_back(device::zeros_f32(r.numel()));
    dptrs.push_back(dbufs.back().as<float>());
  }
  const Buffer q = up(query), w = up(rmsw), dy = up(d_o);
  Buffer o(src[0].nbytes()), dq = device::zeros_f32(D), dw = device::zeros_f32(D);
  cuda::attnres_forward(ptrs, q.as<float>(), w.as<float>(), 1e-5f, o.as<float>(), s);
  cuda::attnres_backward(ptrs, q.as<float>(), w.as<float>(), 1e-5f, dy.as<float>(), dptrs, dq.as<float>(),
                         dw.as<float>(), s);
  Result r{down(o, src[0].shape()), down(dq, {D}), down(dw, {D}), {}};
  for (size_t j = 0; j < src.size(); ++j) r.dsrc.push_back(down(dbufs[j], src[j].shape()));
  return r;
}

TEST(AttnResCuda, MatchesFixture) {
  SafeTensors st = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/ops/attnres.safetensors");
  std::vector<Tensor> src;
  for (int j = 0; st.has("r" + std::to_string(j)); ++j) src.push_back(st.get_f32("r" + std::to_string(j)));
  ASSERT_FALSE(src.empty());
  const Result r = run_cuda(src, st.get_f32("query"), st.get_f32("rmsw"), st.get_f32("do"));
  EXPECT_LE(rel(r.o, st.get_f32("o")), 1e-4);
  EXPECT_LE(rel(r.dq, st.get_f32("grad_query")), 1e-4);
  EXPECT_LE(rel(r.dw, st.get_f32("grad_rmsw")), 1e-4);
  for (size_t j = 0; j < src.size(); ++j)
    EXPECT_LE(rel(r.dsrc[j], st.get_f32("grad_r" + std::to_string(j))), 1e-4) << j;
}

TEST(AttnResCuda, MatchesCpuOnManySources) {
  Rng rng(3);
  const int64_t rows = 50, D = 300;
  auto randn = [&](Shape s) {
    Tensor t = Tensor::empty(std::move(s));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.normal();
    return t;
  };
  std::vector<Tensor> src;
  for (int j = 0; j < 9; ++j) src.push_back(randn({rows, D}));
  const Tensor query = randn({D}), rmsw = randn({D}), d_o = randn({rows, D});
  std::vector<const float*> ptrs;
  std::vector<Tensor> dsrc;
  std::vector<float*> dptrs;
  for (const Tensor& r : src) {
    ptrs.push_back(r.f32());
    dsrc.push_back(Tensor::zeros(r.shape()));
    dptrs.push_back(dsrc.back().f32());
  }
  Tensor o = Tensor::empty({rows, D}), dq = Tensor::zeros({D}), dw = Tensor::zeros({D});
  const AttnResShape s{rows, D};
  attnres_forward(ptrs, query.f32(), rmsw.f32(), 1e-5f, o.f32(), s);
  attnres_backward(ptrs, query.f32(), rmsw.f32(), 1e-5f, d_o.f32(), dptrs, dq.f32(), dw.f32(), s);
  const Result r = run_cuda(src, query, rmsw, d_o);
  EXPECT_LE(rel(r.o, o), 1e-4);
  EXPECT_LE(rel(r.dq, dq), 1e-4);
  EXPECT_LE(rel(r.dw, dw), 1e-4);
  for (size_t j = 0; j < src.size(); ++j) EXPECT_LE(rel(r.dsrc[j], dsrc[j]), 1e-4) << j;
}


// The differentiable op (ag::attnres) on the device against the CPU: output and the gradients of
// every source, the pseudo-query and the norm weight.
TEST(AttnResCuda, AutogradMatchesCpu) {
  Rng rng(21);
  const int64_t M = 13, D = 40;
  std::vector<Var> in;
  for (int j = 0; j < 4; ++j) in.push_back(testing::rand_var(rng, {M, D}));
  in.push_back(testing::rand_var(rng, {1, D}, 0.3f));
  in.push_back(testing::rand_var(rng, {D}));
  std::string what;
  const double d = testing::compare_with_grads(in, [](const std::vector<Var>& v) {
    return ag::attnres(std::vector<Var>(v.begin(), v.begin() + 4), v[4], v[5], 1e-6f);
  }, &what);
  EXPECT_LT(d, 1e-5) << "worst: " << what;
}

}  // namespace
}  // namespace k3
