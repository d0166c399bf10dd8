// What `k3 info` prints: parameters (total, active per token), weight bytes, and the memory one
// sequence needs, by layer kind, at any context length.
#pragma once

#include <string>
#include <vector>

#include "models/model.h"

namespace k3 {

struct WeightBytes {
  std::string format;  // e.g. "fp32", "bf16 + MXFP4 experts"
  double bytes;
};

struct ArchReport {
  std::string name;          // preset or folder
  std::string architecture;  // model_type
  int64_t layers = 0;
  int64_t max_positions = 0;
  int64_t total_params = 0;
  int64_t active_params = 0;
  std::vector<WeightBytes> weights;
  std::vector<LayerMemory> memory;   // one entry per stateful layer and kind
  std::vector<std::string> notes;

  // Bytes one sequence needs at `context` tokens, summed over layers.
  double sequence_bytes(int64_t context) const;
};

// From a built (possibly meta, storage-less) model: counts come from its parameter visitor.
ArchReport report_from_model(const Model& m, const std::string& name);
// Kimi Linear / Kimi K3 configs, counted from the published shapes (spec §5.3, §6-§11).
ArchReport report_kimi(const Json& config, const std::string& name);

}  // namespace k3
