// The registry: the one place that switches on architecture (model_type -> code), plus the
// named presets (configs built into k3).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/report.h"

namespace k3 {

// Loads config.json + weights from a Hugging Face model folder. By default every weight is fp32 on
// the host (training's master weights; block formats inflated). LoadPlan::inference(device,
// storage) keeps a checkpoint's FP8 and MXFP4 weights packed and places each weight on the device
// in its storage as soon as it is read (models/model.h).
std::unique_ptr<Model> load_model(const std::string& dir, const LoadPlan& plan = {});
// Builds a model from a config without weights (parameters are storage-less "meta" tensors
// until init_random or loading).
std::unique_ptr<Model> build_model(const Json& config, const std::string& where);
// Parameter and memory report for a config (works for configs too large to build).
ArchReport report_config(const Json& config, const std::string& name);

std::vector<std::string> preset_names();
Json preset_config(const std::string& name);  // k3::Error listing the presets if unknown
// The same config cut to its first n layers at full width (every other size kept, the layer-kind
// lists trimmed): a real-width slice of a model too large to instantiate whole, so per-layer
// figures are measured. n must be in [1, num_hidden_layers].
Json first_layers(const Json& config, int64_t n, const std::string& where);
struct Preset;
const Preset& find_preset(const std::string& name);

}  // namespace k3
