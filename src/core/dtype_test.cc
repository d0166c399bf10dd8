#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>

namespace k3 {

// Closed forms of the formats' definitions.
TEST(DType, F16DecodesEveryClass) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h);  // exact round trip
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 lies exactly between two bf16 values: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(bf16_to_f32(0xc040), -3.0f);
}

TEST(DType, F8E4M3MatchesTheOcpTable) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);          // 0.0111.000
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);        // largest finite
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
}

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::I64, DType::I32, DType::U8, DType::I8}) {
    DType back;
    ASSERT_TRUE(dtype_from_name(dtype_name(t), &back));
    EXPECT_EQ(back, t);
  }
  DType x;
  EXPECT_FALSE(dtype_from_name("F4", &x));
}

}  // namespace k3
