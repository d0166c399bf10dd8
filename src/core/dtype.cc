#include "core/dtype.h"

#include <cmath>

#include "core/error.h"
#include "core/quant.h"

namespace k3 {

namespace {
struct DTypeInfo {
  DType type;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kInfo[] = {
    {DType::F32, "F32", 4},   {DType::F64, "F64", 8},         {DType::BF16, "BF16", 2},
    {DType::F16, "F16", 2},   {DType::F8E4M3, "F8_E4M3", 1}, {DType::I64, "I64", 8},
    {DType::I32, "I32", 4},   {DType::I8, "I8", 1},           {DType::U8, "U8", 1},
    {DType::Bool, "BOOL", 1}, {DType::F8B128, "F8B128", kF8BlockBytes}, {DType::MXFP4, "MXFP4", kMxfp4BlockBytes},
};
}  // namespace

size_t dtype_size(DType t) { return kInfo[size_t(t)].size; }
int64_t dtype_block(DType t) { return t == DType::F8B128 ? kF8Block : t == DType::MXFP4 ? kMxfp4Block : 1; }
size_t dtype_bytes(DType t, int64_t n) {
  const int64_t b = dtype_block(t);
  K3_CHECK(n % b == 0, n, " values of ", dtype_name(t), " are not whole blocks of ", b);
  return size_t(n / b) * dtype_size(t);
}

std::string_view dtype_name(DType t) { return kInfo[size_t(t)].name; }

bool dtype_from_name(std::string_view name, DType* out) {
  for (const auto& i : kInfo)
    if (name == i.name && !is_block_dtype(i.type)) {
      *out = i.type;
      return true;
    }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: value = man * 2^-24
      float f = std::ldexp(float(man), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;  // overflow to inf (rounds past 65504)
  if (a < 0x38800000u) {                       // subnormal or zero in f16
    float af;
    std::memcpy(&af, &a, 4);
    return sign | uint16_t(std::nearbyint(af * 16777216.0f));  // 2^24, round-half-even
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return sign | uint16_t(r >> 13);
}

float f8e4m3_to_f32(uint8_t v) {
  // OCP FP8 E4M3 (the "fn" variant used by PyTorch/safetensors): bias 7, no infinities,
  // S.1111.111 is NaN.
  uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float r;
  if (exp == 0xf && man == 7) return std::nanf("");
  if (exp == 0)
    r = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  else
    r = std::ldexp(1.0f + float(man) / 8.0f, int(exp) - 7);
  return sign ? -r : r;
}

uint8_t f32_to_f8e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  if (a >= 0x43e00000u) return sign | 0x7e;  // ≥ 448 (and infinity) saturate
  if (a < 0x3c800000u) {                     // below 2^-6: subnormal steps of 2^-9 (code 8 is 2^-6)
    float af;
    std::memcpy(&af, &a, 4);
    return sign | uint8_t(std::nearbyint(af * 512.0f));
  }
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
  const uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  return sign | uint8_t(code > 0x7e ? 0x7e : code);
}

void convert_to_f32(DType from, const void* src, float* dst, size_t n) {
  switch (from) {
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::F64: { auto s = static_cast<const double*>(src); for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]); return; }
    case DType::BF16: { auto s = static_cast<const uint16_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]); return; }
    case DType::F16: { auto s = static_cast<const uint16_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]); return; }
    case DType::F8E4M3: { auto s = static_cast<const uint8_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = f8e4m3_to_f32(s[i]); return; }
    case DType::I64: { auto s = static_cast<const int64_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]); return; }
    case DType::I32: { auto s = static_cast<const int32_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]); return; }
    case DType::I8: { auto s = static_cast<const int8_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]); return; }
    case DType::U8:
    case DType::Bool: { auto s = static_cast<const uint8_t*>(src); for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]); return; }
    case DType::F8B128:
    case DType::MXFP4: dequantize_blocks(from, src, int64_t(n), 0, int64_t(n), dst); return;
  }
  K3_CHECK(false, "unknown dtype");
}

void convert_from_f32(DType to, const float* src, void* dst, size_t n) {
  switch (to) {
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::F64: { auto d = static_cast<double*>(dst); for (size_t i = 0; i < n; ++i) d[i] = src[i]; return; }
    case DType::BF16: { auto d = static_cast<uint16_t*>(dst); for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]); return; }
    case DType::F16: { auto d = static_cast<uint16_t*>(dst); for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]); return; }
    case DType::F8B128:
    case DType::MXFP4: quantize_blocks(to, src, 1, int64_t(n), dst); return;  // as one row (Tensor::to keeps the shape)
    default: throw error("dtype", "cannot convert float32 to ", dtype_name(to));
  }
}

}  // namespace k3
