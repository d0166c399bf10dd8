#include "core/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/fastmath.h"
#include "core/parallel.h"

namespace k3 {

float fp4_e2m1_to_f32(uint8_t code) {
  static const float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

uint8_t f32_to_fp4_e2m1(float x) {
  if (std::isnan(x)) return 0;
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  // Midpoints between the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; a tie goes to the even code.
  static const float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t c = 0;
  while (c < 7 && (a > kMid[c] || (a == kMid[c] && (c & 1) == 1))) ++c;
  return sign | c;
}

float e8m0_to_f32(uint8_t s) { return s == 255 ? std::nanf("") : std::ldexp(1.0f, int(s) - 127); }

namespace {

K3_SIMD_BODY void dequant_f8_body(const uint8_t* codes, const float* scales, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = scales[b];
    const uint8_t* c = codes + b * kF8Block;
    float* d = dst + b * kF8Block;
#pragma omp simd
    for (int i = 0; i < kF8Block; ++i) d[i] = quant::f8_value(c[i]) * s;
  }
}
K3_SIMD_DISPATCH(dequant_f8, (const uint8_t* codes, const float* scales, int64_t blocks, float* dst),
                 (codes, scales, blocks, dst))

K3_SIMD_BODY void dequant_fp4_body(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = quant::e8m0_value(scales[b]);
    const uint8_t* c = codes + b * (kMxfp4Block / 2);
    float* d = dst + b * kMxfp4Block;
#pragma omp simd
    for (int i = 0; i < kMxfp4Block / 2; ++i) {
      d[2 * i] = quant::fp4_value(c[i] & 15u) * s;
      d[2 * i + 1] = quant::fp4_value(uint32_t(c[i]) >> 4) * s;
    }
  }
}
K3_SIMD_DISPATCH(dequant_fp4, (const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* dst),
                 (codes, scales, blocks, dst))

}  // namespace

void dequantize_blocks(DType t, const void* base, int64_t n, int64_t begin, int64_t count, float* dst) {
  const int64_t blk = dtype_block(t);
  K3_CHECK(blk > 1 && n % blk == 0 && begin % blk == 0 && count % blk == 0 && begin + count <= n,
           "dequantize_blocks: values [", begin, ", ", begin + count, ") of ", n, " ", dtype_name(t));
  const uint8_t* codes = block_codes(base);
  if (t == DType::F8B128)
    dequant_f8(codes + begin, static_cast<const float*>(block_scales(t, base, n)) + begin / blk, count / blk, dst);
  else
    dequant_fp4(codes + begin / 2, static_cast<const uint8_t*>(block_scales(t, base, n)) + begin / blk, count / blk,
                dst);
}

namespace {
void quantize_f8b128(const float* src, int64_t rows, int64_t cols, uint8_t* codes, float* scales) {
  const int64_t cb = cols / kF8Block;
  parallel_for((rows + kF8Block - 1) / kF8Block, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kF8Block, r1 = std::min(rows, r0 + kF8Block);
      for (int64_t j = 0; j < cb; ++j) {
        float amax = 0;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = j * kF8Block; c < (j + 1) * kF8Block; ++c) amax = std::max(amax, std::fabs(src[r * cols + c]));
        const float scale = amax > 0 && std::isfinite(amax) ? amax / kF8Max : 1.0f;
        for (int64_t r = r0; r < r1; ++r) {
          scales[r * cb + j] = scale;
          for (int64_t c = j * kF8Block; c < (j + 1) * kF8Block; ++c)
            codes[r * cols + c] = f32_to_f8e4m3(src[r * cols + c] / scale);
        }
      }
    }
  });
}

void quantize_mxfp4(const float* src, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales) {
  const int64_t blocks = rows * cols / kMxfp4Block;
  parallel_for(blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = src + b * kMxfp4Block;
      float amax = 0;
      for (int i = 0; i < kMxfp4Block; ++i) amax = std::max(amax, std::fabs(x[i]));
      // Shared exponent ⌊log2 amax⌋ − 2 (E2M1's largest exponent), within E8M0's range.
      int s = 127;
      if (amax > 0 && std::isfinite(amax)) s = std::clamp(std::ilogb(amax) - 2 + 127, 0, 254);
      scales[b] = uint8_t(s);
      const float inv = 1.0f / e8m0_to_f32(uint8_t(s));
      for (int i = 0; i < kMxfp4Block; i += 2)
        codes[b * kMxfp4Block / 2 + i / 2] =
            uint8_t(f32_to_fp4_e2m1(x[i] * inv) | (f32_to_fp4_e2m1(x[i + 1] * inv) << 4));
    }
  });
}
}  // namespace

void quantize_blocks(DType t, const float* src, int64_t rows, int64_t cols, void* base) {
  const int64_t blk = dtype_block(t);
  K3_CHECK(blk > 1 && cols % blk == 0, "quantize_blocks: rows of ", cols, " values are not whole blocks of ", blk, " (",
           dtype_name(t), ")");
  const int64_t n = rows * cols;
  uint8_t* codes = static_cast<uint8_t*>(base);
  void* scales = codes + (static_cast<const uint8_t*>(block_scales(t, base, n)) - codes);
  if (t == DType::F8B128)
    quantize_f8b128(src, rows, cols, codes, static_cast<float*>(scales));
  else
    quantize_mxfp4(src, rows, cols, codes, static_cast<uint8_t*>(scales));
}

}  // namespace k3
