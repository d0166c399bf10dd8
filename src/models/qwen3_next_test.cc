// Qwen3-Next's training path (the fixture tests cover its forward): gradients through the fused
// Gated DeltaNet projections and conv, the zero-centred norms, the gated attention's q/k norms and
// output gate, and the shared expert's gate match central differences of the loss.
#include <gtest/gtest.h>

#include <map>

#include "models/registry.h"
#include "models/testing.h"
#include "ops/gradcheck.h"

namespace k3 {

TEST(Qwen3Next, GradientsMatchFiniteDifferences) {
  auto model = load_model(testing::fixture_model("qwen3-next-tiny"));
  const std::vector<std::string> names = {
      "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
      "model.layers.0.linear_attn.conv1d.weight",       "model.layers.0.linear_attn.A_log",
      "model.layers.0.linear_attn.norm.weight",         "model.layers.0.input_layernorm.weight",
      "model.layers.3.self_attn.q_proj.weight",         "model.layers.3.self_attn.q_norm.weight",
      "model.layers.3.self_attn.k_norm.weight",         "model.layers.3.mlp.shared_expert_gate.weight",
      "model.norm.weight"};
  std::map<std::string, Var> params;
  model->visit([&](const std::string& n, Node& p, ParamKind) {
    p.value = p.value.clone();  // writable copies (the checkpoint's are mapped read-only)
    p.requires_grad = false;
    for (const auto& want : names)
      if (n == want) params[n] = Var(&p, [](Node*) {});
  });
  ASSERT_EQ(params.size(), names.size());
  const std::vector<int64_t> ids = {5, 17, 301, 42, 7, 99, 250, 3, 11, 64, 128, 2};
  std::vector<int64_t> targets(ids.begin() + 1, ids.end());
  targets.push_back(-1);
  const TokenBatch batch{ids.data(), 2, 6, nullptr};
  // Each input on its own, so a failure names it. Small steps (the router's top-k can flip under a
  // large one), except for q_proj, whose gradients are small enough that a 1e-3 step's differences
  // sink into the fp32 loss's rounding.
  for (auto& [name, v] : params) {
    v->requires_grad = true;
    const float step = name.ends_with("q_proj.weight") ? 3e-2f : 1e-3f;
    const double err = testing::gradcheck([&](const std::vector<Var>&) { return model->loss(batch, targets); }, {v},
                                          step, 24);
    EXPECT_LT(err, 2e-2) << name;
    v->requires_grad = false;
  }
}

}  // namespace k3
