// Batched decode over device memories for every delta-rule preset (random weights at the preset's
// shape): the GPU's steps, whose delta layers hand the decode kernel their raw activations (q/k
// normalisation, β's sigmoid and the decay gate fused into the state step), against the same
// steps on the CPU, whose layers apply each op on its own. Needs a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "models/registry.h"
#include "models/testing.h"

namespace k3 {
namespace {

class PresetDecodeCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(PresetDecodeCuda, BatchedStepsMatchTheCpu) {
  auto model = build_model(preset_config(GetParam()), GetParam());
  model->init_random(3);
  const int64_t V = model->vocab_size();
  std::vector<std::vector<float>> got[2];
  got[0] = testing::unequal_batched_decode(*model, 4);
  move_to(*model, Device::CUDA);
  got[1] = testing::unequal_batched_decode(*model, 4);
  for (size_t i = 0; i < got[0].size(); ++i)
    EXPECT_LT(testing::rel_l2(got[1][i].data(), got[0][i].data(), 2 * V), 1e-4) << GetParam() << " step " << i;
}

INSTANTIATE_TEST_SUITE_P(Presets, PresetDecodeCuda,
                         ::testing::Values("linear-tiny", "deltanet-tiny", "gdn-tiny", "kda-tiny", "kimi-linear-tiny",
                                           "k3-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace k3
