#include "ops/activation.h"

#include <cmath>

#include "core/parallel.h"

namespace k3 {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
}

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      float v = x[i];
      y[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
    }
  });
}

void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      float v = x[i];
      float u = kSqrt2OverPi * (v + 0.044715f * v * v * v);
      float t = std::tanh(u);
      float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * v * v);
      dx[i] += dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
  });
}

}  // namespace k3
