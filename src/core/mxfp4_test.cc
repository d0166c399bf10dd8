// MXFP4 decoding against the OCP Microscaling definitions (closed forms).
#include "core/mxfp4.h"

#include <gtest/gtest.h>

#include <cmath>

namespace k3 {

TEST(Mxfp4, E2M1CodesAndE8M0Scales) {
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint8_t c = 0; c < 16; ++c) EXPECT_EQ(fp4_e2m1_to_f32(c), expect[c]) << int(c);
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(120), 1.0f / 128);
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(Mxfp4, EvenColumnsInTheLowNibble) {
  // One row of 64 values: two groups of 32 with scales 2^1 and 2^-2.
  uint8_t packed[32], scales[2] = {128, 125};
  for (int i = 0; i < 32; ++i) packed[i] = uint8_t((i % 16) | ((15 - i % 16) << 4));
  float out[64];
  dequantize_mxfp4(packed, scales, 1, 64, out);
  for (int c = 0; c < 64; ++c) {
    const uint8_t byte = packed[c / 2];
    const uint8_t code = c % 2 ? byte >> 4 : byte & 15;
    EXPECT_EQ(out[c], fp4_e2m1_to_f32(code) * (c < 32 ? 2.0f : 0.25f)) << c;
  }
}

}  // namespace k3
