// Test helpers for comparing against reference outputs.
#pragma once

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "models/model.h"

namespace k3::testing {

// ‖x − ref‖ / ‖ref‖ over n floats, in double.
inline double rel_l2(const float* x, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    double d = double(x[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

inline std::string fixture_model(const std::string& name) {
  return std::string(K3_SHARED_DIR) + "/fixtures/models/" + name;
}

// deepseek-v3-tiny's multi-token-prediction reference (tools/make_mtp_goldens.py): the MTP
// layer's weights by checkpoint name, ids, mtp_logits, draft_logits.
inline std::string mtp_golden() {
  return std::string(K3_SOURCE_DIR) + "/tests/data/mtp/deepseek_v3_tiny_mtp.safetensors";
}

// A temporary folder holding deepseek-v3-tiny's weights and the golden's MTP layer as one sharded
// checkpoint (the caller removes it).
inline std::string checkpoint_with_mtp() {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("k3_mtp_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fx = fixture_model("deepseek-v3-tiny");
  fs::copy_file(fx + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  fs::copy_file(fx + "/model.safetensors", dir / "main.safetensors", fs::copy_options::overwrite_existing);
  fs::copy_file(mtp_golden(), dir / "mtp.safetensors", fs::copy_options::overwrite_existing);
  Json map = Json::object();
  for (const auto& n : SafeTensors::open(fx + "/model.safetensors").names()) map[n] = "main.safetensors";
  for (const auto& n : SafeTensors::open(mtp_golden()).names())
    if (n.rfind("model.layers.", 0) == 0) map[n] = "mtp.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << Json{{"weight_map", map}}.dump();
  return dir.string();
}

// Two sequences of different lengths (7 and 4 tokens) prefilled into contexts on the model's
// device, then `steps` batched decode steps (B = 2, T = 1): each step's last logits [2, V].
inline std::vector<std::vector<float>> unequal_batched_decode(const Model& model, int64_t steps) {
  const int64_t V = model.vocab_size();
  const std::vector<int64_t> a = {5, 9, 2, 31, 7, 7, 40}, b = {3, 8, 1, 12};
  Context ca = model.new_context(16), cb = model.new_context(16);
  std::vector<float> out(static_cast<size_t>(2 * V));
  model.forward(a.data(), int64_t(a.size()), &ca, out.data(), Logits::Last);
  model.forward(b.data(), int64_t(b.size()), &cb, out.data(), Logits::Last);
  Context* both[2] = {&ca, &cb};
  std::vector<std::vector<float>> got;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t ids[2] = {11 + step, 17 + step};
    model.logits(TokenBatch{ids, 2, 1, both}, out.data(), Logits::Last);
    got.push_back(out);
  }
  return got;
}

}  // namespace k3::testing
