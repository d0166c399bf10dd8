#include "ops/ag_conv.h"

#include "core/error.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/parallel.h"

namespace k3 {

void short_conv_forward(const float* x, const float* w, const float* tail, int64_t T, int64_t C, int64_t W, float* y) {
  const int64_t P = W - 1;
  for (int64_t t = 0; t < T; ++t) {
    float* yr = y + t * C;
    std::fill(yr, yr + C, 0.0f);
    for (int64_t i = 0; i < W; ++i) {
      const int64_t s = t - P + i;  // input time, < 0 reads the tail
      const float* xr = s >= 0 ? x + s * C : (tail ? tail + (P + s) * C : nullptr);
      if (!xr) continue;
      for (int64_t c = 0; c < C; ++c) yr[c] += w[c * W + i] * xr[c];
    }
  }
}

void short_conv_backward(const float* x, const float* w, const float* dy, int64_t T, int64_t C, int64_t W, float* dx,
                         float* dw) {
  const int64_t P = W - 1;
  // Tap-major copies of w and of dw's increments ([W, C]): the loops over channels then read and
  // write contiguously, and vectorise.
  std::vector<float> wt(size_t(W * C)), dwt(dw ? size_t(W * C) : 0, 0.0f);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < W; ++i) wt[size_t(i * C + c)] = w[c * W + i];
  for (int64_t t = 0; t < T; ++t) {
    const float* g = dy + t * C;
    for (int64_t i = 0; i < W; ++i) {
      const int64_t s = t - P + i;
      if (s < 0) continue;
      if (dx) {
        float* d = dx + s * C;
        const float* wi = wt.data() + i * C;
        for (int64_t c = 0; c < C; ++c) d[c] += wi[c] * g[c];
      }
      if (dw) {
        const float* xr = x + s * C;
        float* di = dwt.data() + i * C;
        for (int64_t c = 0; c < C; ++c) di[c] += xr[c] * g[c];
      }
    }
  }
  if (dw)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t i = 0; i < W; ++i) dw[c * W + i] += dwt[size_t(i * C + c)];
}

void short_conv_update_tail(const float* x, int64_t T, int64_t C, int64_t W, float* tail) {
  const int64_t P = W - 1;
  if (P <= 0) return;
  std::vector<float> all(static_cast<size_t>((P + T) * C));
  std::memcpy(all.data(), tail, static_cast<size_t>(P * C) * sizeof(float));
  std::memcpy(all.data() + P * C, x, static_cast<size_t>(T * C) * sizeof(float));
  std::memcpy(tail, all.data() + T * C, static_cast<size_t>(P * C) * sizeof(float));
}

namespace ag {

Var short_conv(const Var& x, const Var& w, int64_t B, int64_t T) {
  const Tensor& X = x->value;
  const int64_t C = X.dim(-1);
  const int64_t W = w->value.numel() / std::max<int64_t>(1, C);
  K3_CHECK(X.numel() == B * T * C, "short_conv: x ", X.describe(), " for B=", B, " T=", T);
  K3_CHECK(w->value.dim(0) == C && W * C == w->value.numel() && W >= 1, "short_conv: weight ", w->value.describe(),
           " for ", C, " channels");
  if (X.device() != w->value.device())
    throw error("short_conv", "x ", X.describe(), " is on ", device_words(X.device()), " but the weight ",
                w->value.describe(), " is on ", device_words(w->value.device()));
  const bool cuda = X.device() == Device::CUDA;
  Tensor y = Tensor::empty_on(X.device(), X.shape());
  if (cuda) {
#if defined(K3_HAS_CUDA)
    cuda::short_conv(X.cuda_f32(), w->value.cuda_f32(), B, T, C, W, y.cuda_f32());
#endif
  } else {
    parallel_for(B, 1, [&](int64_t s, int64_t e) {
      for (int64_t b = s; b < e; ++b)
        short_conv_forward(X.f32() + b * T * C, w->value.f32(), nullptr, T, C, W, y.f32() + b * T * C);
    });
  }
  return make_node(std::move(y), {x, w}, [x, w, B, T, C, W, cuda](Node& self) {
    if (cuda) {
#if defined(K3_HAS_CUDA)
      return cuda::short_conv_backward(x->value.cuda_f32(), w->value.cuda_f32(), self.grad.cuda_f32(), B, T, C, W,
                                       needs_grad(x) ? x->grad_cuda() : nullptr, needs_grad(w) ? w->grad_cuda() : nullptr);
#endif
    }
    const float* dy = self.grad.f32();
    float* dx = needs_grad(x) ? x->grad_f32() : nullptr;
    float* dw = needs_grad(w) ? w->grad_f32() : nullptr;
    // Sequences in parallel, each with its own dw, added up afterwards in sequence order.
    std::vector<float> dws(dw ? size_t(B * C * W) : 0, 0.0f);
    parallel_for(B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        short_conv_backward(x->value.f32() + b * T * C, w->value.f32(), dy + b * T * C, T, C, W,
                            dx ? dx + b * T * C : nullptr, dw ? dws.data() + b * C * W : nullptr);
    });
    if (dw)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < C * W; ++i) dw[i] += dws[size_t(b * C * W + i)];
  }, "short_conv");
}

}  // namespace ag
}  // namespace k3
