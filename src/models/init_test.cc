// init_normal draws its weights in parallel pieces of one SplitMix stream: the values are those of
// the stream drawn in order (so seeded runs reproduce), whatever the thread count.
#include <gtest/gtest.h>

#include "core/random.h"
#include "models/init.h"
#include "models/registry.h"

namespace k3 {

TEST(InitNormal, ParallelPiecesEqualTheSequentialStream) {
  auto model = build_model(preset_config("k3-tiny"), "k3-tiny");
  init_normal(*model, 9, 0.02f);
  Rng seq(9);
  int64_t checked = 0;
  model->visit([&](const std::string& name, Node& p, ParamKind k) {
    const float* w = p.value.f32();
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      float want;
      if (k == ParamKind::Norm) want = name.ends_with(".bias") ? 0.0f : 1.0f;
      else if (k == ParamKind::Bias || k == ParamKind::Other) want = 0.0f;
      else want = 0.02f * seq.normal();
      if (w[i] != want) {
        ADD_FAILURE() << name << "[" << i << "] = " << w[i] << ", the stream's value is " << want;
        return;
      }
      ++checked;
    }
  });
  EXPECT_EQ(checked, model->total_params());
}

}  // namespace k3
