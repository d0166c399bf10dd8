// GPT-2 specifics (the fixture comparisons are in fixture_models_test.cc).
#include "models/gpt2.h"

#include <gtest/gtest.h>

#include "infer/generate.h"
#include "models/registry.h"
#include "models/testing.h"

namespace k3 {


TEST(Gpt2, PresetCountsMatchTheSpec) {
  auto m = build_model(preset_config("gpt2"), "gpt2");
  EXPECT_EQ(m->total_params(), 124439808);  // spec §1
  ArchReport r = report_from_model(*m, "gpt2");
  double kv = 0;
  for (const auto& lm : r.memory) kv += lm.spec.per_token_bytes;
  EXPECT_EQ(kv, 73728.0);  // 2·L·d fp32 (spec §1)
}

TEST(Gpt2, BadCheckpointsGiveClearErrors) {
  Json c = preset_config("gpt2");
  c["n_head"] = 5;
  EXPECT_THROW(build_model(c, "cfg"), Error);
  c = preset_config("gpt2");
  c.erase("n_embd");
  EXPECT_THROW(build_model(c, "cfg"), Error);
  c["model_type"] = "gpt7";
  try {
    build_model(c, "cfg");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown architecture"), std::string::npos);
  }
  EXPECT_THROW(load_model("/nonexistent"), Error);
}

}  // namespace k3
