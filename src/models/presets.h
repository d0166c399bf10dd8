// Built-in configs: the published models (for k3 info) and small trainable ones.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/config.h"

namespace k3 {

// What `k3 train --preset NAME` uses when a flag is not given.
struct TrainDefaults {
  int64_t steps = 0, batch = 0, seq_len = 0, warmup = 0;
  float lr = 0;
};

struct Preset {
  std::string name;
  std::string description;
  std::function<Json()> config;
  std::optional<TrainDefaults> train;  // set for trainable presets
};

const std::vector<Preset>& presets();

}  // namespace k3
