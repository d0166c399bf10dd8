#include "mixers/mla/latent_attention.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/device.h"
#include "core/profile.h"
#include "mixers/mixers_cuda.h"
#include "mixers/mla/mla.h"
#include "ops/gemm.h"

namespace k3 {

namespace {

LatentCache* host_cache(Memory* m, int64_t b) {
  auto* c = dynamic_cast<LatentCache*>(m);
  K3_CHECK(c && c->rows().device() == Device::CPU, "mla: sequence ", b, "'s memory is not a host latent cache");
  return c;
}

Tensor attend_latents_host(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                           Memory* const* memories) {
  const int64_t H = s.H, T = s.T, R = s.R, rd = s.rope, nope = s.nope, vd = s.v, qd = nope + rd, W = R + rd;
  std::vector<LatentCache*> caches(static_cast<size_t>(s.B));
  for (int64_t b = 0; b < s.B; ++b) {  // all or none
    caches[size_t(b)] = host_cache(memories[b], b);
    caches[size_t(b)]->rows().reserve(T);
  }
  const float* wkv = kv_b.f32();  // [H·(nope+v), R]
  Tensor att = Tensor::empty({s.B * T, H * vd});
  std::vector<float> qt(static_cast<size_t>(W)), ob(static_cast<size_t>(R)), p;
  for (int64_t b = 0; b < s.B; ++b) {
    LatentCache* cache = caches[size_t(b)];
    const int64_t p0 = cache->length();
    cache->append(rows.f32() + b * T * W, T);
    const float* lat = cache->data();  // [p0 + T, W]
    p.resize(static_cast<size_t>(p0 + T));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = q.f32() + ((b * T + t) * H + h) * qd;
        const float* wuk = wkv + h * (nope + vd) * R;  // [nope, R]
        // q̃ = W_UKᵀ q_nope (R values), then the rope part unchanged: a query over [c ; k_rope].
        gemm(Trans::No, Trans::No, 1, R, nope, 1.0f, qh, nope, wuk, R, 0.0f, qt.data(), R);
        std::memcpy(qt.data() + R, qh + nope, size_t(rd) * 4);
        const int64_t n = p0 + t + 1;
        gemm(Trans::No, Trans::Yes, 1, n, W, s.scale, qt.data(), W, lat, W, 0.0f, p.data(), n);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[size_t(j)]);
        double z = 0;
        for (int64_t j = 0; j < n; ++j) z += p[size_t(j)] = std::exp(p[size_t(j)] - mx);
        for (int64_t j = 0; j < n; ++j) p[size_t(j)] = float(p[size_t(j)] / z);
        // ō = Σ p_s c_s (R), then o_h = W_UV ō.
        gemm(Trans::No, Trans::No, 1, R, n, 1.0f, p.data(), n, lat, W, 0.0f, ob.data(), R);
        const float* wuv = wuk + nope * R;  // [v, R]
        gemm(Trans::No, Trans::Yes, 1, vd, R, 1.0f, ob.data(), R, wuv, R, 0.0f, att.f32() + (b * T + t) * H * vd + h * vd,
             vd);
      }
  }
  return att;
}

}  // namespace

Tensor attend_latents(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                      Memory* const* memories) {
  K3_CHECK(q.numel() == s.B * s.T * s.H * (s.nope + s.rope) && rows.numel() == s.B * s.T * (s.R + s.rope) &&
               kv_b.numel() == s.H * (s.nope + s.v) * s.R,
           "mla: q ", q.describe(), " rows ", rows.describe(), " kv_b ", kv_b.describe(), " do not fit B=", s.B,
           " T=", s.T, " H=", s.H);
  if (q.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) return gpu::latent_attention(q, rows, kv_b, s, memories);
  }
  profile::Scope scope("latent attention");
  return attend_latents_host(q.is_contiguous() ? q : q.clone(), rows.is_contiguous() ? rows : rows.clone(), kv_b,
                             s, memories);
}

}  // namespace k3
