// One MoE layer (layer 1) of each fixture model against tools/moe_reference.py, which computes
// it in float64 from the spec's math (§8.1, §8.2, §9) with unbiased combine weights and was
// checked against transformers' DeepseekV3MoE / KimiLinearMoE (rel L2 ≈ 3e-7).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ffn/moe.h"
#include "io/safetensors.h"

namespace k3 {

namespace {

double rel_l2(const float* x, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void load(const MoE& m, const std::string& model, const std::string& prefix) {
  SafeTensors st = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/models/" + model + "/model.safetensors");
  m.visit(prefix, [&](const std::string& name, Node& p, ParamKind) {
    ASSERT_TRUE(st.has(name)) << name;
    ASSERT_EQ(st.entry(name).shape, p.value.shape()) << name;
    p.value = st.get_f32(name).clone();
  });
}

void check_layer(const MoE& m, const std::string& model, const std::string& prefix) {
  load(m, model, prefix);
  SafeTensors ref = SafeTensors::open(std::string(K3_SOURCE_DIR) + "/tests/data/moe/" + model + "_layer1.safetensors");
  Var x = constant(ref.get_f32("x").clone());
  Var y = m.forward(x);
  Tensor yr = ref.get_f32("y");
  ASSERT_EQ(y->value.shape(), yr.shape());
  EXPECT_LT(rel_l2(y->value.f32(), yr.f32(), yr.numel()), 1e-5) << model;

  // Routing: the reference stores each token's experts in ascending order.
  const Routing& r = m.last_routing();
  Tensor idx = ref.get("topk_idx"), w = ref.get_f32("topk_weight");
  const int64_t T = idx.dim(0), K = idx.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<int64_t, float>> got;
    for (int64_t k = 0; k < K; ++k) got.push_back({r.indices[size_t(t * K + k)], r.weights[size_t(t * K + k)]});
    std::sort(got.begin(), got.end());
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(got[size_t(k)].first, idx.data<int64_t>()[t * K + k]) << model << " token " << t;
      EXPECT_NEAR(got[size_t(k)].second, w.f32()[t * K + k], 1e-5) << model << " token " << t;
    }
  }
}

}  // namespace

TEST(MoEFixture, DeepseekV3Layer1) {
  MoeOptions o;  // config.json of deepseek-v3-tiny
  o.d_model = 128;
  o.n_experts = 8;
  o.top_k = 2;
  o.expert_hidden = 64;
  o.n_shared = 1;
  o.n_group = 2;
  o.topk_group = 1;
  o.routed_scaling = 2.5f;
  o.names = MoeNames::deepseek();
  check_layer(MoE(o), "deepseek-v3-tiny", "model.layers.1.mlp");
}

TEST(MoEFixture, KimiLinearLayer1) {
  MoeOptions o;  // config.json of kimi-linear-tiny; combine weights unbiased (see moe.h)
  o.d_model = 128;
  o.n_experts = 8;
  o.top_k = 2;
  o.expert_hidden = 64;
  o.n_shared = 1;
  o.routed_scaling = 2.446f;
  o.names = MoeNames::kimi();
  check_layer(MoE(o), "kimi-linear-tiny", "model.layers.1.block_sparse_moe");
}

TEST(MoEFixture, KimiK3LatentLayer1) {
  MoeOptions o;  // text_config of kimi-k3-tiny
  o.d_model = 128;
  o.n_experts = 8;
  o.top_k = 2;
  o.expert_hidden = 64;
  o.n_shared = 2;
  o.routed_scaling = 1.0f;
  o.latent_dim = 64;
  o.latent_norm = LatentNorm::RMSNorm;
  o.norm_eps = 1e-5f;
  o.activation = GluActivation::SiTU;
  o.situ = SituOptions{4.0f, 25.0f};
  o.names = MoeNames::kimi();
  check_layer(MoE(o), "kimi-k3-tiny", "language_model.model.layers.1.block_sparse_moe");
}

}  // namespace k3
