#include "core/fastmath.h"

#include <cstdlib>
#include <cstring>

namespace k3 {

namespace simd {
Level level() {
  static const Level best = [] {
    Level l = Level::Base;
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) l = Level::Avx2;
    if (l == Level::Avx2 && __builtin_cpu_supports("avx512f")) l = Level::Avx512;
#endif
    if (const char* cap = std::getenv("K3_SIMD")) {
      if (std::strcmp(cap, "base") == 0) l = Level::Base;
      if (std::strcmp(cap, "avx2") == 0 && l == Level::Avx512) l = Level::Avx2;
    }
    return l;
  }();
  return best;
}
}  // namespace simd

K3_SIMD_BODY void exp_array_body(const float* x, float* y, int64_t n, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(x[i] - shift);
}
K3_SIMD_DISPATCH(exp_array, (const float* x, float* y, int64_t n, float shift), (x, y, n, shift))

}  // namespace k3
