// The published configs built into k3 count what their publishers state: DeepSeek-V3 671B total /
// 37B activated (its technical report), Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B (their names:
// total and activated parameters), and the per-sequence memory their layer kinds imply.
#include <gtest/gtest.h>

#include "models/registry.h"

namespace k3 {

namespace {
double per_token(const ArchReport& r, MemoryKind k) {
  double b = 0;
  for (const auto& lm : r.memory)
    if (lm.spec.kind == k) b += lm.spec.per_token_bytes;
  return b;
}
double fixed(const ArchReport& r, MemoryKind k) {
  double b = 0;
  for (const auto& lm : r.memory)
    if (lm.spec.kind == k) b += lm.spec.fixed_bytes;
  return b;
}
}  // namespace

TEST(PublishedPresets, DeepseekV3CountsItsStatedParameters) {
  const ArchReport r = report_config(preset_config("deepseek-v3"), "deepseek-v3");
  EXPECT_NEAR(double(r.total_params), 671e9, 0.5e9);
  EXPECT_NEAR(double(r.active_params), 37e9, 0.5e9);
  // 61 MLA layers of a 512 + 64 latent row, in bf16 on the device.
  EXPECT_EQ(per_token(r, MemoryKind::LatentCache), 61.0 * 576 * 2 * 2);
}

TEST(PublishedPresets, KimiLinear48bCountsItsStatedParameters) {
  const ArchReport r = report_config(preset_config("kimi-linear-48b"), "kimi-linear-48b");
  EXPECT_NEAR(double(r.total_params), 48.5e9, 1e9);  // "48B"
  EXPECT_NEAR(double(r.active_params), 3e9, 0.5e9);  // "A3B"
  EXPECT_EQ(r.layers, 27);
  // 20 KDA layers of 32 heads of 128 × 128 fp32 states; 7 MLA layers' latent rows.
  EXPECT_EQ(fixed(r, MemoryKind::RecurrentState), 20.0 * 32 * 128 * 128 * 4);
  EXPECT_EQ(per_token(r, MemoryKind::LatentCache), 7.0 * 576 * 2);
}

TEST(PublishedPresets, Qwen3Next80bCountsItsStatedParameters) {
  const Json c = preset_config("qwen3-next-80b");
  const ArchReport r = report_config(c, "qwen3-next-80b");
  EXPECT_NEAR(double(r.total_params), 80e9, 1e9);         // "80B"
  EXPECT_NEAR(double(r.active_params), 3.5e9, 0.6e9);     // "A3B" (with the head's 0.3B)
  // 36 Gated DeltaNet layers of 32 value heads of 128 × 128 fp32 states.
  EXPECT_EQ(fixed(r, MemoryKind::RecurrentState), 36.0 * 32 * 128 * 128 * 4);
  auto m = build_model(c, "qwen3-next-80b");  // storage-less
  EXPECT_EQ(m->total_params(), r.total_params);
}

// A real-width slice: the first n layers, every width kept, the layer-kind lists cut to them.
TEST(PublishedPresets, FirstLayersKeepTheWidthAndTheLayerKinds) {
  const Json k3 = first_layers(preset_config("kimi-k3"), 8, "kimi-k3");
  const Json& lac = k3["text_config"]["linear_attn_config"];
  EXPECT_EQ(k3["text_config"]["num_hidden_layers"], 8);
  EXPECT_EQ(lac["full_attn_layers"], Json::array({4, 8}));
  EXPECT_EQ(lac["kda_layers"], Json::array({1, 2, 3, 5, 6, 7}));
  EXPECT_EQ(k3["text_config"]["hidden_size"], 7168);
  const ArchReport whole = report_config(preset_config("kimi-k3"), "k3"), cut = report_config(k3, "k3/8");
  EXPECT_EQ(cut.layers, 8);
  EXPECT_LT(cut.total_params, whole.total_params / 8);

  // Qwen3-Next: every fourth layer is attention, so four layers hold one; the per-layer widths stay.
  const Json q = first_layers(preset_config("qwen3-next-80b"), 4, "q");
  auto m = build_model(q, "q");
  int attention = 0, gdn = 0;
  m->visit([&](const std::string& n, Node& p, ParamKind) {
    attention += n.ends_with("self_attn.q_proj.weight");
    if (n.ends_with("linear_attn.in_proj_qkvz.weight")) {
      ++gdn;
      EXPECT_EQ(p.value.shape(), Shape({12288, 2048}));
    }
  });
  EXPECT_EQ(attention, 1);
  EXPECT_EQ(gdn, 3);
  EXPECT_EQ(first_layers(preset_config("gpt2"), 2, "gpt2")["n_layer"], 2);

  for (int64_t bad : {0, 49})
    try {
      first_layers(preset_config("qwen3-next-80b"), bad, "q");
      ADD_FAILURE() << bad << " layers accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not in [1, 48]"), std::string::npos) << e.what();
    }
}

}  // namespace k3
