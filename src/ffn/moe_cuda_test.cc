// The MoE on CUDA (routed experts in one pass, moe_cuda.h) against the CPU MoE: plain SiLU and
// latent SiTU configurations (the latter combining biased weights), fp32 and bf16 expert weights,
// with many tokens per expert (prefill) and one token (decode), experts that receive no token,
// and both device forms: every expert on every row with the ids kept on the device (M · E ≤
// MoE::kDenseRows) and the routed rows only. The device's expert selection
// against the host's select_experts on scores made to break it (ties, NaN, −inf, groups).
#include "ffn/moe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/random.h"
#include "ffn/moe_cuda.h"

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
    o.combine = CombineWeights::Biased;
  }
  return o;
}

}  // namespace

TEST(MoeCuda, RoutedExpertsInOnePassMatchTheCpu) {
  if (device::cuda_device_count() == 0) GTEST_FAIL() << "no CUDA device";
  for (bool latent : {false, true})
    for (DType wt : {DType::F32, DType::BF16})
      for (int64_t M : {int64_t(1), int64_t(3), int64_t(70), int64_t(600)}) {
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
        const std::vector<int64_t> ref_load = m.last_routing().load;

        m.visit("", [&](const std::string& name, Node& p, ParamKind) {
          p.value = (wt == DType::BF16 && routed_weight(name) ? p.value.to(DType::BF16) : p.value).to_device(Device::CUDA);
        });
        const Tensor got = m.forward(constant(x.to_device(Device::CUDA)))->value.to_device(Device::CPU);
        EXPECT_EQ(m.last_routing().indices, ref_idx);
        ASSERT_EQ(m.last_routing().weights.size(), ref_w.size());
        for (size_t i = 0; i < ref_w.size(); ++i) EXPECT_NEAR(m.last_routing().weights[i], ref_w[i], 1e-5);
        // bf16: the device also rounds the routed rows and the GLU output to bf16 for the GEMMs.
        EXPECT_LT(rel(got, ref), wt == DType::F32 ? 1e-5 : 1e-2);
        EXPECT_EQ(m.last_routing().load, ref_load);
        const bool dense = m.runs_dense(M);
        EXPECT_EQ(dense, M * m.opts.n_experts <= MoE::kDenseRows) << "these experts are small";
        if (dense)  // every expert ran on every row
          EXPECT_EQ(m.rows_processed(), std::vector<int64_t>(size_t(m.opts.n_experts), M));
        else
          EXPECT_EQ(m.rows_processed(), m.last_routing().load);
      }
}

// Device top-k selection = host select_experts, id for id and in order: plain and grouped routing
// (DeepSeek's 8 groups of 32 keep 4; Kimi K3's 896 experts in one group), a selection bias, scores
// quantised so that ties are common, NaN and −inf scores, and a group of NaNs.
TEST(MoeCuda, DeviceSelectionMatchesTheHost) {
  if (device::cuda_device_count() == 0) GTEST_FAIL() << "no CUDA device";
  struct Case {
    int64_t E, K, n_group, topk_group;
    bool bias;
  };
  const Case cases[] = {{8, 2, 1, 1, false}, {16, 4, 1, 1, true}, {256, 8, 8, 4, true},
                        {64, 6, 4, 2, false}, {896, 8, 1, 1, true}, {32, 4, 32, 4, false}};
  Rng rng(5);
  for (const Case& c : cases) {
    const int64_t M = 67;
    Tensor scores = Tensor::empty({M, c.E}), bias = Tensor::empty({c.E});
    for (int64_t i = 0; i < scores.numel(); ++i) scores.f32()[i] = std::round(rng.uniform() * 8.0f) / 8.0f;  // ties
    for (int64_t e = 0; e < c.E; ++e) bias.f32()[e] = std::round((rng.uniform() - 0.5f) * 4.0f) / 8.0f;
    scores.f32()[3] = NAN;
    scores.f32()[c.E + 1] = -INFINITY;
    for (int64_t e = 0; e < std::min<int64_t>(c.E, c.E / c.n_group); ++e) scores.f32()[2 * c.E + e] = NAN;  // group 0
    for (int64_t e = 0; e < c.E; ++e) scores.f32()[3 * c.E + e] = 0.5f;  // all tied
    std::vector<float> choice(size_t(M * c.E));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t e = 0; e < c.E; ++e)
        choice[size_t(m * c.E + e)] = scores.f32()[m * c.E + e] + (c.bias ? bias.f32()[e] : 0.0f);
    const std::vector<int64_t> want = select_experts(choice.data(), M, c.E, c.K, c.n_group, c.topk_group);
    const std::vector<int64_t> got =
        gpu::select_experts(scores.to_device(Device::CUDA), c.bias ? bias.to_device(Device::CUDA) : Tensor(), c.K,
                            c.n_group, c.topk_group);
    EXPECT_EQ(got, want) << "E " << c.E << " K " << c.K << " groups " << c.n_group << "/" << c.topk_group;
  }
}

}  // namespace k3
