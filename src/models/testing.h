// Test helpers for comparing against reference outputs.
#pragma once

#include <cmath>
#include <string>

#include "core/tensor.h"

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

}  // namespace k3::testing
