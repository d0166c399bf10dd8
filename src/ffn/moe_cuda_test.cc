// The MoE on CUDA (routed experts in one pass, moe_cuda.h) against the CPU MoE: plain SiLU and
// latent SiTU configurations, fp32 and bf16 expert weights, with many tokens per expert (prefill)
// and one token (decode), and experts that receive no token.
#include "ffn/moe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/random.h"

namespace k3 {
namespace {

double rel(const Tensor& a, const Tensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double d = double(a.f32()[i]) - ref.f32()[i];
    num += d * d;
    den += double(ref.f32()[i]) * ref.f32()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

bool routed_weight(const std::string& name) { return name.starts_with("experts.") && name.ends_with(".weight"); }

MoeOptions options(bool latent) {
  MoeOptions o;
  o.d_model = 48;
  o.n_experts = latent ? 16 : 8;
  o.top_k = latent ? 4 : 2;
  o.expert_hidden = 40;
  o.n_shared = 1;
  o.routed_scaling = latent ? 1.0f : 2.5f;
  if (latent) {
    o.latent_dim = 24;
    o.latent_norm = LatentNorm::RMSNorm;
    o.activation = GluActivation::SiTU;
    o.situ = SituOptions{4.0f, 25.0f};
  }
  return o;
}

}  // namespace

TEST(MoeCuda, RoutedExpertsInOnePassMatchTheCpu) {
  if (device::cuda_device_count() == 0) GTEST_FAIL() << "no CUDA device";
  for (bool latent : {false, true})
    for (DType wt : {DType::F32, DType::BF16})
      for (int64_t M : {int64_t(1), int64_t(3), int64_t(70)}) {
        SCOPED_TRACE(testing::Message() << "latent " << latent << " bf16 " << (wt == DType::BF16) << " M " << M);
        MoE m(options(latent));
        Rng rng(11 + uint64_t(M));
        m.visit("", [&](const std::string& name, Node& p, ParamKind) {
          p.value = Tensor::empty(p.value.shape());
          const bool norm = name.find("norm") != std::string::npos, bias = name.ends_with("bias");
          for (int64_t i = 0; i < p.value.numel(); ++i)
            p.value.f32()[i] = norm ? 1.0f + 0.1f * rng.normal() : bias ? 0.1f * rng.normal() : 0.3f * rng.normal();
          // The CPU reference uses the weights the device holds (bf16-rounded routed experts).
          if (wt == DType::BF16 && routed_weight(name)) p.value = p.value.to(DType::BF16).to(DType::F32);
        });
        Tensor x = Tensor::empty({M, 48});
        for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
        const Tensor ref = m.forward(constant(x))->value;
        const std::vector<int64_t> ref_idx = m.last_routing().indices;
        const std::vector<float> ref_w = m.last_routing().weights;

        m.visit("", [&](const std::string& name, Node& p, ParamKind) {
          p.value = (wt == DType::BF16 && routed_weight(name) ? p.value.to(DType::BF16) : p.value).to_device(Device::CUDA);
        });
        const Tensor got = m.forward(constant(x.to_device(Device::CUDA)))->value.to_device(Device::CPU);
        EXPECT_EQ(m.last_routing().indices, ref_idx);
        ASSERT_EQ(m.last_routing().weights.size(), ref_w.size());
        for (size_t i = 0; i < ref_w.size(); ++i) EXPECT_NEAR(m.last_routing().weights[i], ref_w[i], 1e-5);
        // bf16: the device also rounds the routed rows and the GLU output to bf16 for the GEMMs.
        EXPECT_LT(rel(got, ref), wt == DType::F32 ? 1e-5 : 1e-2);
        EXPECT_EQ(m.rows_processed(), m.last_routing().load);
      }
}

}  // namespace k3
