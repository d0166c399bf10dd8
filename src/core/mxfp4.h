// MXFP4 (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32), as Kimi K3 stores its
// routed experts (compressed-tensors "mxfp4-pack-quantized", spec §8.2 / §11):
//   weight_packed [rows, cols/2] u8: two 4-bit codes per byte, the even column in the low nibble
//   weight_scale  [rows, cols/32] u8: E8M0, scale = 2^(s − 127)
// value = fp4(code) · scale, fp4 = (−1)^sign · {0, 0.5, 1, 1.5, 2, 3, 4, 6}[code & 7].
#pragma once

#include <cstdint>

namespace k3 {

float fp4_e2m1_to_f32(uint8_t code);  // low 4 bits
float e8m0_to_f32(uint8_t s);         // 2^(s-127); 255 is NaN
// out[rows, cols] from packed [rows, cols/2] and scales [rows, cols/32]. cols % 32 == 0.
void dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out);

}  // namespace k3
