#include "core/mxfp4.h"

#include <cmath>

namespace k3 {

float fp4_e2m1_to_f32(uint8_t code) {
  static const float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

float e8m0_to_f32(uint8_t s) { return s == 255 ? std::nanf("") : std::ldexp(1.0f, int(s) - 127); }

void dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out) {
  const int64_t half = cols / 2, groups = cols / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t byte = packed[r * half + c / 2];
      const uint8_t code = (c % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      out[r * cols + c] = fp4_e2m1_to_f32(code) * e8m0_to_f32(scales[r * groups + c / 32]);
    }
}

}  // namespace k3
