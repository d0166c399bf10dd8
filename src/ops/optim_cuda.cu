// AdamW on CUDA (ops/optim.h): one tensor, or a group of tensors in one launch.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

__global__ void adamw_kernel(float* w, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2,
                             float eps, float wd, double c1, double c2) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i];
  const float mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  const double mhat = mi / c1, vhat = vi / c2;
  w[i] -= lr * float(mhat / (sqrt(vhat) + eps) + wd * w[i]);
}

// One block per chunk (tensor index, chunk index within it) of kAdamChunk values; four values a
// thread (float4) where the tensor's four arrays are 16-byte aligned (chunks start at multiples
// of 4,096 values). Bias corrections as reciprocals in fp32: the step's rounding is that of the
// fp32 arrays it writes (the tests hold it to the double closed form within 1e-6).
constexpr int kAdamChunk = 4096;
struct AdamW1 {
  float lr, b1, b2, eps, wd, inv_c1, inv_c2;
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    p -= lr * (m * inv_c1 / (sqrtf(v * inv_c2) + eps) + wd * p);
  }
};
__global__ void adamw_group_kernel(const AdamWTensor* tensors, const int2* chunks, float lr, float b1, float b2,
                                   float eps, float inv_c1, float inv_c2) {
  const int2 c = chunks[blockIdx.x];
  const AdamWTensor t = tensors[c.x];
  const AdamW1 step{lr, b1, b2, eps, t.weight_decay, inv_c1, inv_c2};
  const int64_t i0 = int64_t(c.y) * kAdamChunk, i1 = i0 + kAdamChunk < t.n ? i0 + kAdamChunk : t.n;
  int64_t i = i0;
  const uintptr_t addr_bits = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(t.grad) |
                              reinterpret_cast<uintptr_t>(t.m) | reinterpret_cast<uintptr_t>(t.v);
  auto* pb = static_cast<__nv_bfloat16*>(t.param_bf16);
  if ((addr_bits & 15) == 0 && (reinterpret_cast<uintptr_t>(pb) & 7) == 0) {
    for (int64_t j = i0 / 4 + threadIdx.x; j < i1 / 4; j += blockDim.x) {
      float4 p = reinterpret_cast<float4*>(t.param)[j], m = reinterpret_cast<float4*>(t.m)[j],
             v = reinterpret_cast<float4*>(t.v)[j];
      const float4 g = reinterpret_cast<const float4*>(t.grad)[j];
      step(p.x, g.x, m.x, v.x), step(p.y, g.y, m.y, v.y), step(p.z, g.z, m.z, v.z), step(p.w, g.w, m.w, v.w);
      reinterpret_cast<float4*>(t.param)[j] = p, reinterpret_cast<float4*>(t.m)[j] = m,
                                     reinterpret_cast<float4*>(t.v)[j] = v;
      if (pb) reinterpret_cast<uint2*>(pb)[j] = pack_bf16x4(p);
    }
    i = i1 / 4 * 4;  // the tensor's last 0-3 values
  }
  for (i += threadIdx.x; i < i1; i += blockDim.x) {
    step(t.param[i], t.grad[i], t.m[i], t.v[i]);
    if (pb) pb[i] = __float2bfloat16(t.param[i]);
  }
}

}  // namespace

AdamWGroup::AdamWGroup(const std::vector<AdamWTensor>& tensors) {
  std::vector<int2> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t count = (tensors[t].n + kAdamChunk - 1) / kAdamChunk;
    if (count > INT32_MAX || t > size_t(INT32_MAX))
      throw error("adamw", "a tensor of ", tensors[t].n, " values is too large");
    for (int64_t c = 0; c < count; ++c) chunks.push_back(make_int2(int(t), int(c)));
  }
  chunks_count_ = int64_t(chunks.size());
  if (chunks_count_ > INT32_MAX) throw error("adamw", chunks_count_, " chunks are more than one launch takes");
  if (!chunks.empty()) {
    tensors_ = device::upload_new(tensors.data(), tensors.size() * sizeof(AdamWTensor));
    chunks_ = device::upload_new(chunks.data(), chunks.size() * sizeof(int2));
  }
}
void AdamWGroup::step(const AdamWStep& s) const {
  if (!chunks_count_) return;
  const double c1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double c2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  adamw_group_kernel<<<unsigned(chunks_count_), kThreads, 0, device::stream()>>>(
      tensors_.as<AdamWTensor>(), chunks_.as<int2>(), s.lr, s.beta1, s.beta2, s.eps, float(1.0 / c1), float(1.0 / c2));
  K3_CUDA_LAUNCHED();
}

void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s) {
  if (!n) return;
  const double c1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double c2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  adamw_kernel<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
      param, grad, m, v, n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, c1, c2);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
