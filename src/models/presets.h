// Built-in configs: the published models (for k3 info) and small trainable ones.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "io/config.h"

namespace k3 {

struct Preset {
  std::string name;
  std::string description;
  std::function<Json()> config;
};

const std::vector<Preset>& presets();

}  // namespace k3
