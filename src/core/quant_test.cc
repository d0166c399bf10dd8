// Block formats (FP8 with block scales, MXFP4) against the OCP definitions and exhaustive searches.
#include "core/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

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
  uint8_t block[32 + 2];  // the codes, then the scales, as an MXFP4 tensor holds them
  uint8_t *packed = block, *scales = block + 32;
  scales[0] = 128, scales[1] = 125;
  for (int i = 0; i < 32; ++i) packed[i] = uint8_t((i % 16) | ((15 - i % 16) << 4));
  float out[64];
  dequantize_blocks(DType::MXFP4, block, 64, 0, 64, out);
  for (int c = 0; c < 64; ++c) {
    const uint8_t byte = packed[c / 2];
    const uint8_t code = c % 2 ? byte >> 4 : byte & 15;
    EXPECT_EQ(out[c], fp4_e2m1_to_f32(code) * (c < 32 ? 2.0f : 0.25f)) << c;
  }
}

}  // namespace k3

namespace k3 {
namespace {

// The nearest representable value by exhaustive search over the codes (ties to the even code):
// the definition of round-to-nearest-even, independent of the bit arithmetic under test.
template <class Decode>
uint8_t nearest_code(float x, int codes, Decode decode) {
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < codes; ++c) {
    const float v = decode(uint8_t(c));
    if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
    const double err = std::fabs(double(v) - double(x));
    if (best < 0 || err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) best = c, best_err = err;
  }
  return uint8_t(best);
}

TEST(Fp8, EncodeIsTheNearestCodeTiesToEven) {
  std::vector<float> xs;
  for (int c = 0; c < 256; ++c) {  // every code, and the midpoints and near-midpoints between neighbours
    const float v = f8e4m3_to_f32(uint8_t(c)), w = f8e4m3_to_f32(uint8_t(c + 1));
    if (std::isnan(v)) continue;
    xs.push_back(v);
    if ((c & 0x7f) < 0x7e && !std::isnan(w)) {
      const float mid = (v + w) / 2;
      xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f * (v < 0 ? -1 : 1))});
    }
  }
  for (float x : {1e-4f, 1e-3f, 3e-3f, 0.1f, 0.3f, 7.7f, 100.0f, 300.0f, 447.0f, -0.0123f, -250.5f}) xs.push_back(x);
  for (float x : xs) {
    const uint8_t want = nearest_code(x, 256, f8e4m3_to_f32);
    EXPECT_EQ(f32_to_f8e4m3(x), want) << x;
  }
  EXPECT_EQ(f32_to_f8e4m3(1000.0f), 0x7e);  // saturates at 448
  EXPECT_EQ(f32_to_f8e4m3(-INFINITY), 0xfe);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(f32_to_f8e4m3(NAN))));
}

TEST(Mxfp4, EncodeIsTheNearestCodeTiesToEven) {
  for (float x = -7.0f; x <= 7.0f; x += 0.0625f) {
    const float a = std::fmin(std::fabs(x), kFp4Max);
    const uint8_t want = nearest_code(std::copysign(a, x), 16, fp4_e2m1_to_f32);
    EXPECT_EQ(f32_to_fp4_e2m1(x), want) << x;
  }
}

// The packed tensor's decode, block by block, against the scalar definitions above.
TEST(BlockFormats, DequantizeMatchesTheScalarDecode) {
  {
    const int64_t n = 2 * kF8Block;
    Tensor t = Tensor::empty({1, n}, DType::F8B128);
    EXPECT_EQ(t.nbytes(), size_t(n + 2 * 4));
    uint8_t* codes = t.data<uint8_t>();
    for (int64_t i = 0; i < n; ++i) codes[i] = uint8_t(i);
    float* scales = reinterpret_cast<float*>(codes + n);
    scales[0] = 0.5f, scales[1] = -3.0f;
    std::vector<float> out(static_cast<size_t>(n));
    dequantize_blocks(DType::F8B128, t.raw(), n, 0, n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      const float want = f8e4m3_to_f32(uint8_t(i)) * scales[i / kF8Block];
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(out[size_t(i)])) << i;
      else EXPECT_EQ(out[size_t(i)], want) << i;
    }
  }
  {
    const int64_t n = 3 * kMxfp4Block;
    Tensor t = Tensor::empty({n}, DType::MXFP4);
    EXPECT_EQ(t.nbytes(), size_t(n / 2 + 3));
    uint8_t* codes = t.data<uint8_t>();
    for (int64_t i = 0; i < n / 2; ++i) codes[i] = uint8_t(i * 7);
    uint8_t* scales = codes + n / 2;
    scales[0] = 127, scales[1] = 0, scales[2] = 140;
    std::vector<float> out(static_cast<size_t>(n));
    dequantize_blocks(DType::MXFP4, t.raw(), n, kMxfp4Block, 2 * kMxfp4Block, out.data());  // the last two blocks
    for (int64_t i = kMxfp4Block; i < n; ++i) {
      const uint8_t byte = codes[i / 2], code = i % 2 ? byte >> 4 : byte & 15;
      EXPECT_EQ(out[size_t(i - kMxfp4Block)], fp4_e2m1_to_f32(code) * e8m0_to_f32(scales[i / kMxfp4Block])) << i;
    }
  }
}

TEST(BlockFormats, QuantizeByTilesAndBlocks) {
  const int64_t rows = 130, cols = 256;  // two tiles of rows (128 and 2), two of columns
  std::vector<float> x(size_t(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i)) * (i % 97 == 0 ? 40.0f : 1.0f);
  Tensor w = Tensor::from_vector(x, {rows, cols});
  {
    const Tensor q = w.to(DType::F8B128), back = q.to(DType::F32);
    const float* scales = reinterpret_cast<const float*>(q.data<uint8_t>() + rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < 2; ++j) {
        float amax = 0;  // the tile's largest magnitude
        for (int64_t rr = r / 128 * 128; rr < std::min(rows, r / 128 * 128 + 128); ++rr)
          for (int64_t c = j * 128; c < j * 128 + 128; ++c) amax = std::fmax(amax, std::fabs(x[size_t(rr * cols + c)]));
        ASSERT_EQ(scales[r * 2 + j], amax / 448.0f) << r << "," << j;
        for (int64_t c = j * 128; c < j * 128 + 128; ++c) {  // each value is the nearest E4M3 code times the scale
          const float v = x[size_t(r * cols + c)];
          ASSERT_EQ(back.f32()[r * cols + c], f8e4m3_to_f32(nearest_code(v / scales[r * 2 + j], 256, f8e4m3_to_f32)) *
                                                  scales[r * 2 + j]);
        }
      }
  }
  {
    const Tensor q = w.to(DType::MXFP4), back = q.to(DType::F32);
    const uint8_t* scales = q.data<uint8_t>() + rows * cols / 2;
    for (int64_t b = 0; b < rows * cols / 32; ++b) {
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[size_t(b * 32 + i)]));
      const int e = int(std::floor(std::log2(amax))) - 2;  // OCP MX: the shared exponent
      ASSERT_EQ(int(scales[b]), e + 127) << b;
      for (int i = 0; i < 32; ++i) {
        const float v = x[size_t(b * 32 + i)] / std::ldexp(1.0f, e);
        const float a = std::fmin(std::fabs(v), kFp4Max);
        ASSERT_EQ(back.f32()[b * 32 + i], fp4_e2m1_to_f32(nearest_code(std::copysign(a, v), 16, fp4_e2m1_to_f32)) *
                                               std::ldexp(1.0f, e));
      }
    }
  }
  EXPECT_THROW(Tensor::empty({4, 100}, DType::MXFP4), Error);  // rows are whole blocks
  EXPECT_THROW(w.to(DType::F8B128).slice(0, 0, 1), Error);
}

}  // namespace
}  // namespace k3
