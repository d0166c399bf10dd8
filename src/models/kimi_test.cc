// The parameter report of `k3 info` (analytic, from the config) agrees with the modules k3
// builds (storage-less), and with the published figures of spec §11.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "models/testing.h"

namespace k3 {

TEST(KimiReport, PublishedK3MatchesTheSpec) {
  ArchReport r = report_config(preset_config("kimi-k3"), "kimi-k3");
  EXPECT_EQ(r.total_params, 2779484476000);  // spec §11
  EXPECT_NEAR(double(r.active_params), 104.2e9, 0.01 * 104.2e9);
  double latent = 0, state = 0;
  for (const auto& lm : r.memory) {
    if (lm.spec.kind == MemoryKind::LatentCache) latent += lm.spec.per_token_bytes;
    if (lm.spec.kind == MemoryKind::RecurrentState) state += lm.spec.fixed_bytes;
  }
  EXPECT_EQ(latent, 27648.0);                      // bf16 latent cache, B/token
  EXPECT_EQ(state, 414.0 * 1024 * 1024);           // fp32 KDA state, B/sequence
  ArchReport seed = report_config(preset_config("kimi-k3-seed"), "kimi-k3-seed");
  EXPECT_EQ(seed.layers, 92);
  EXPECT_NEAR(double(seed.total_params), 2.749e12, 0.001e12);
}

TEST(KimiReport, AnalyticCountEqualsTheBuiltModules) {
  for (const char* p : {"kimi-linear-small", "k3-small", "kimi-k3"}) {
    Json c = preset_config(p);
    auto m = build_model(c, p);  // storage-less: nothing allocated even for 2.8T parameters
    ArchReport r = report_config(c, p);
    EXPECT_EQ(m->total_params(), r.total_params) << p;
    EXPECT_EQ(m->active_params(), r.active_params) << p;
  }
}

TEST(KimiReport, FixtureModelCountsMatchTheirCheckpoints) {
  auto m = load_model(testing::fixture_model("kimi-linear-tiny"));
  ArchReport r = report_config(read_json_file(testing::fixture_model("kimi-linear-tiny") + "/config.json"), "kimi-linear-tiny");
  EXPECT_EQ(m->total_params(), r.total_params);
}

}  // namespace k3
