// Branch-free fp32 math that vectorises (glibc's scalar expf does not), for the CPU kernels that
// take many exponentials: the chunked delta rule's decays, the sampler's softmax weights.
#pragma once

#include <bit>
#include <cstdint>

// One clone per ISA level (AVX-512 / AVX2+FMA / baseline SSE2), dispatched through an ifunc at load
// time: the build targets baseline x86-64. GCC only: clang's target_clones differs, and sanitizer
// / fuzz builds do not need the speed.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define K3_SIMD_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define K3_SIMD_CLONES
#endif

namespace k3 {

// exp(x) in fp32 without calls or branches, so that loops using it vectorise. Cody–Waite range
// reduction x = n ln2 + r (|r| ≤ ln2/2), a degree-7 polynomial for e^r (the classic Cephes
// coefficients), and 2^n built from the exponent bits. Max relative error ≈ 1.4 ulp over
// [−87.3, 88]; below −87.3 (e^x < FLT_MIN) it returns 0 instead of a denormal, above 88 it
// saturates at e^88.
inline float exp_approx(float x) {
  constexpr float kLo = -87.33654f, kHi = 88.0f;
  const float xc = x < kLo ? kLo : (x > kHi ? kHi : x);
  // Round to nearest by the 1.5·2^23 trick (vectorises without SSE4.1's roundps).
  const float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;  // ln2 split in a short high part and a correction
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n ∈ [−126, 127] after the clamp, so the biased exponent is a normal one.
  const float y = p * std::bit_cast<float>((int32_t(n) + 127) << 23);
  return x < kLo ? 0.0f : y;
}

// y[i] = exp_approx(x[i]) (x == y allowed), in the widest vectors the machine has.
void exp_array(const float* x, float* y, int64_t n);

}  // namespace k3
