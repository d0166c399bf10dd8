// Block-quantised weight formats, held packed in memory and multiplied without inflating them:
//   DType::F8B128  FP8 E4M3 ("fn": bias 7, no infinities) values with one fp32 scale per 128
//                  consecutive values of a row. DeepSeek-V3 and Kimi ship one scale per 128 × 128
//                  tile ("<name>_scale_inv"); here each tile's scale is repeated on its rows.
//   DType::MXFP4   OCP Microscaling FP4 (E2M1) values, two per byte (the even column in the low
//                  nibble), with one E8M0 scale per 32 (Kimi K3's routed experts, compressed-tensors
//                  "mxfp4-pack-quantized": "<name>_packed" + "<name>_scale").
// value = code's value · block's scale. A tensor of n such values keeps its codes and then its
// scales in one allocation, each row-major:
//   F8B128: n bytes of codes, then n/128 floats;   MXFP4: n/2 bytes of codes, then n/32 bytes.
// The last dimension is a multiple of the block, so no block straddles two rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/dtype.h"

namespace k3 {

inline constexpr int64_t kF8Block = 128, kMxfp4Block = 32;
inline constexpr size_t kF8BlockBytes = kF8Block + 4, kMxfp4BlockBytes = kMxfp4Block / 2 + 1;
inline constexpr float kF8Max = 448.0f, kFp4Max = 6.0f;

float fp4_e2m1_to_f32(uint8_t code);  // low 4 bits
uint8_t f32_to_fp4_e2m1(float x);     // nearest (ties to the even code), saturating at ±6; NaN → 0
float e8m0_to_f32(uint8_t s);         // 2^(s-127); 255 is NaN

// Branch-free decodes, inlined into vectorised loops (core/fastmath.h's K3_SIMD_BODY kernels).
namespace quant {
[[gnu::always_inline]] inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
[[gnu::always_inline]] inline uint32_t as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
[[gnu::always_inline]] inline float f8_value(uint8_t v) {
  const uint32_t em = v & 0x7fu;
  // Normal: the exponent rebased from 7 to 127 and the 3 mantissa bits on top of fp32's; subnormal
  // (exponent 0): em · 2^-9. S.1111.111 is NaN.
  const float normal = as_float((em << 20) + (120u << 23));
  const float sub = float(int32_t(em)) * 0.001953125f;
  float r = em < 8 ? sub : normal;
  r = em == 0x7f ? std::numeric_limits<float>::quiet_NaN() : r;
  return as_float(as_bits(r) | (uint32_t(v & 0x80u) << 24));
}
[[gnu::always_inline]] inline float fp4_value(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  // e > 0: (1 + m/2) · 2^(e-1); e == 0: m/2.
  const uint32_t bits = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);
  return as_float(bits | ((c & 8u) << 28));
}
[[gnu::always_inline]] inline float e8m0_value(uint8_t s) {
  return s == 255 ? std::numeric_limits<float>::quiet_NaN() : as_float(s ? uint32_t(s) << 23 : 0x00400000u);
}
}  // namespace quant

// The codes and scales of a block tensor of n values at `base`.
inline const uint8_t* block_codes(const void* base) { return static_cast<const uint8_t*>(base); }
inline const void* block_scales(DType t, const void* base, int64_t n) {
  return static_cast<const uint8_t*>(base) + (t == DType::MXFP4 ? n / 2 : n);
}

// Values [begin, begin + count) of the n at `base` into dst as fp32 (begin and count whole blocks).
void dequantize_blocks(DType t, const void* base, int64_t n, int64_t begin, int64_t count, float* dst);
// Quantises src [rows, cols] into `base` (cols a multiple of the block). F8B128 scales by each
// 128 × 128 tile's largest magnitude over 448 (DeepSeek-V3's recipe, so the tensor can be written in
// its layout); MXFP4 by 2^(⌊log2 max⌋ − 2) per 32 (the OCP MX conversion: larger values saturate).
void quantize_blocks(DType t, const float* src, int64_t rows, int64_t cols, void* base);

}  // namespace k3
