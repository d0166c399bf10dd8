// Test helpers for comparing against reference outputs.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "core/tensor.h"
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
