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

}  // namespace k3
