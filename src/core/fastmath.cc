#include "core/fastmath.h"

namespace k3 {

K3_SIMD_CLONES void exp_array(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(x[i]);
}

}  // namespace k3
