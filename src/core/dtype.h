// Element types and the conversions between them. Compute is fp32 on the CPU; other types are
// storage formats read from checkpoints (bf16, f16, f8_e4m3), index types (i32, i64, u8, i8), or
// block-quantised weight formats whose values share a scale per block (F8B128, MXFP4: core/quant.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace k3 {

enum class DType : uint8_t { F32, F64, BF16, F16, F8E4M3, I64, I32, I8, U8, Bool, F8B128, MXFP4 };

// Bytes per element; a block format's are per block (dtype_bytes counts any number of values).
size_t dtype_size(DType t);
// Values that share one scale: 1, or 128 (F8B128) and 32 (MXFP4). A block-format tensor's last
// dimension is a multiple of its block.
int64_t dtype_block(DType t);
inline bool is_block_dtype(DType t) { return dtype_block(t) > 1; }
// The bytes n values take (codes and scales of a block format; n a multiple of its block).
size_t dtype_bytes(DType t, int64_t n);
std::string_view dtype_name(DType t);  // safetensors spelling: "F32", "BF16", ... (block formats: "F8B128", "MXFP4")
// Safetensors dtypes only: the block formats are stored as several tensors, never by that name.
bool dtype_from_name(std::string_view name, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// The fp32 value a bf16 store would keep (what a bf16 tensor holds after f32 → bf16 → f32).
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f8e4m3_to_f32(uint8_t v);
// Nearest E4M3 value (ties to even), saturating at ±448; NaN stays NaN.
uint8_t f32_to_f8e4m3(float f);

// Converts n elements of type `from` at src into fp32 at dst (a block format's n values: its codes
// and then its scales, core/quant.h).
void convert_to_f32(DType from, const void* src, float* dst, size_t n);
// Converts n fp32 elements into type `to` (float types only; a block format quantises each block).
void convert_from_f32(DType to, const float* src, void* dst, size_t n);

}  // namespace k3
