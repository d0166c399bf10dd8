// Rotary position embedding on CUDA (ops/rope.h): a block per row, angles in double as on the host.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

template <class T>
__global__ void rope_kernel(T* x, int64_t H, int64_t hd, int64_t offset, int64_t half, const int64_t* positions,
                            const double* inv_freq, double factor, int direction, bool half_pairs) {
  const int64_t m = blockIdx.x;
  const double pos = double(positions[m]);
  for (int64_t e = threadIdx.x; e < H * half; e += blockDim.x) {
    const int64_t h = e / half, i = e % half;
    double sd, cd;
    sincos(pos * inv_freq[i], &sd, &cd);
    const float c = float(cd * factor), s = float(sd * factor) * float(direction > 0 ? 1 : -1);
    T* p = x + (m * H + h) * hd + offset;
    const int64_t i0 = half_pairs ? i : 2 * i, i1 = half_pairs ? i + half : 2 * i + 1;
    const float a = to_f32(p[i0]), b = to_f32(p[i1]);
    p[i0] = from_f32<T>(a * c - b * s);
    p[i1] = from_f32<T>(a * s + b * c);
  }
}

}  // namespace

void rope_apply(void* x, int64_t M, int64_t H, int64_t hd, int64_t offset, int64_t rot, const int64_t* positions,
                const double* inv_freq, double attn_factor, int direction, Storage st, bool half_pairs) {
  if (!M || rot <= 0) return;
  K3_DISPATCH_STORAGE(st, T,
                      rope_kernel<T><<<unsigned(M), 128, 0, device::stream()>>>(
                          static_cast<T*>(x), H, hd, offset, rot / 2, positions, inv_freq, attn_factor, direction,
                          half_pairs));
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
