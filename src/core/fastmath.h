// Branch-free fp32 math that vectorises (glibc's scalar expf does not), for the CPU kernels that
// take many exponentials: the chunked delta rule's decays, the sampler's softmax weights.
#pragma once

#include <bit>
#include <cstdint>

namespace k3 {

// The build targets baseline x86-64, so the kernels that want wide vectors are compiled once per
// ISA level (AVX-512 / AVX2 + FMA / baseline SSE2) and one is picked by the CPU's features. (GCC
// 12's target_clones resolver, used before, matched "arch=haswell" by CPU model and picked the
// baseline clone on AMD EPYC, the machines k3 is built and tested on.)
namespace simd {
enum class Level : int { Base = 0, Avx2 = 1, Avx512 = 2 };
// The best level the CPU has (detected once); the environment variable K3_SIMD=base or avx2 caps
// it (to compare the forms).
Level level();
}  // namespace simd

}  // namespace k3

// Usage, in a .cc: the kernel as `K3_SIMD_BODY void f_body(params) {...}` (inlined into each
// form, so that each compiles for its ISA), then `K3_SIMD_DISPATCH(f, (params), (args))` defines
// `void f(params)`, which calls the form for simd::level(). GCC on x86-64 only; elsewhere the body.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define K3_SIMD_BODY [[gnu::always_inline]] inline
#define K3_SIMD_DISPATCH(NAME, PARAMS, ARGS)                                                    \
  __attribute__((target("avx2,fma"))) static void NAME##_avx2 PARAMS { NAME##_body ARGS; }        \
  __attribute__((target("avx512f,avx2,fma"))) static void NAME##_avx512 PARAMS { NAME##_body ARGS; } \
  void NAME PARAMS {                                                                             \
    switch (::k3::simd::level()) {                                                               \
      case ::k3::simd::Level::Avx512: NAME##_avx512 ARGS; return;                                \
      case ::k3::simd::Level::Avx2: NAME##_avx2 ARGS; return;                                    \
      case ::k3::simd::Level::Base: break;                                                       \
    }                                                                                            \
    NAME##_body ARGS;                                                                            \
  }
#else
#define K3_SIMD_BODY inline
#define K3_SIMD_DISPATCH(NAME, PARAMS, ARGS) \
  void NAME PARAMS { NAME##_body ARGS; }
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

// tanh(x) from exp_approx, branch-free: (1 − e)/(1 + e) with e = e^{−2|x|}, the sign put back;
// below |x| = 0.3, where 1 − e would cancel, the odd Taylor series to x¹¹ (its first omitted
// term is below 1e-9 relative there). Within 4e-7 relative of tanh; exactly ±1 beyond |x| ≈ 9.
inline float tanh_approx(float x) {
  const float a = __builtin_fabsf(x);
  const float e = exp_approx(-2.0f * a);
  const float big = (1.0f - e) / (1.0f + e);
  const float a2 = a * a;
  float p = -1382.0f / 155925.0f;
  p = p * a2 + 62.0f / 2835.0f;
  p = p * a2 - 17.0f / 315.0f;
  p = p * a2 + 2.0f / 15.0f;
  p = p * a2 - 1.0f / 3.0f;
  const float small = a + a * a2 * p;
  return __builtin_copysignf(a < 0.3f ? small : big, x);
}

// σ(x) = 1/(1 + e^{−x}) from exp_approx (relative error a few ulps; 0 … 1 at the extremes).
inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// y[i] = exp_approx(x[i] − shift) (x == y allowed), in the widest vectors the machine has. The
// shift is a softmax's row maximum: one pass instead of a subtraction and then the exponentials.
void exp_array(const float* x, float* y, int64_t n, float shift = 0.0f);

}  // namespace k3
