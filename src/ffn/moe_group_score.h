// The group score of grouped top-k expert selection, one definition for the host (moe.cc) and the
// device (moe_route_cuda.cu), which must pick the same experts: the sum of the group's two best
// choice scores, or its one score when the group has one. NaN never enters it (every comparison
// with NaN is false).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define K3_MOE_HOST_DEVICE __host__ __device__
#else
#define K3_MOE_HOST_DEVICE
#endif

namespace k3 {

// Over c[begin, end).
K3_MOE_HOST_DEVICE inline float moe_group_score(const float* c, int64_t begin, int64_t end) {
  float b1 = -INFINITY, b2 = -INFINITY;
  for (int64_t j = begin; j < end; ++j) {
    if (c[j] > b1) {
      b2 = b1;
      b1 = c[j];
    } else if (c[j] > b2) {
      b2 = c[j];
    }
  }
  return end - begin > 1 ? b1 + b2 : b1;
}

}  // namespace k3

#undef K3_MOE_HOST_DEVICE
