#include "ops/ag_norms.h"

#include "ops/ag_cuda.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/parallel.h"
#include "ops/activation.h"

namespace k3::ag {

namespace {
// Groups per parallel chunk: about 4K elements.
int64_t grain(int64_t d) { return std::max<int64_t>(1, 4096 / d); }
int64_t groups(const Var& x, int64_t d, const char* op) {
  K3_CHECK(d > 0 && x->value.numel() % d == 0 && x->value.dim(-1) % d == 0, op, ": ", x->value.describe(),
           " is not made of heads of ", d);
  return x->value.numel() / d;
}
}  // namespace

Var l2norm(const Var& x, int64_t d, float eps) {
  K3_AG_CUDA(x, l2norm(x, d, eps));
  const int64_t G = groups(x, d, "l2norm");
  Tensor y = Tensor::empty(x->value.shape());
  auto rinv = std::make_shared<std::vector<float>>(static_cast<size_t>(G));
  const float* px = x->value.f32();
  float* py = y.f32();
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += double(px[g * d + j]) * px[g * d + j];
      const float r = float(1.0 / std::sqrt(s + double(eps)));
      (*rinv)[size_t(g)] = r;
      for (int64_t j = 0; j < d; ++j) py[g * d + j] = px[g * d + j] * r;
    }
  });
  return make_node(std::move(y), {x}, [x, rinv, G, d](Node& self) {
    // dx = r (dy − y (y·dy))
    const float* dy = self.grad.f32();
    const float* yv = self.value.f32();
    float* dx = x->grad_f32();
    parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        double dot = 0;
        for (int64_t j = 0; j < d; ++j) dot += double(yv[g * d + j]) * dy[g * d + j];
        const float r = (*rinv)[size_t(g)];
        for (int64_t j = 0; j < d; ++j) dx[g * d + j] += r * (dy[g * d + j] - yv[g * d + j] * float(dot));
      }
    });
  }, "l2norm");
}

Var gated_rmsnorm(const Var& x, const Var& gate, const Var& w, int64_t d, float eps, NormGate act) {
  K3_AG_CUDA(x, gated_rmsnorm(x, gate, w, d, eps, act));
  const int64_t G = groups(x, d, "gated_rmsnorm");
  K3_CHECK((act == NormGate::None) == !gate, "gated_rmsnorm: a gate needs an activation and vice versa");
  if (gate) K3_CHECK(gate->value.shape() == x->value.shape(), "gated_rmsnorm: gate ", gate->value.describe(), " vs x ", x->value.describe());
  if (w) K3_CHECK(w->value.numel() == d, "gated_rmsnorm: weight ", w->value.describe(), " for heads of ", d);
  Tensor y = Tensor::empty(x->value.shape());
  auto rstd = std::make_shared<std::vector<float>>(static_cast<size_t>(G));
  const float* px = x->value.f32();
  const float* pw = w ? w->value.f32() : nullptr;
  float* py = y.f32();
  // σ(gate) once, vectorised (the gate's activation and its derivative both come from it).
  std::vector<float> sg(gate ? size_t(x->value.numel()) : 0);
  if (gate) sigmoid_forward(gate->value.f32(), sg.data(), x->value.numel());
  const float* pg = gate ? gate->value.f32() : nullptr;
  auto actf = [act](float z, float s) { return act == NormGate::Sigmoid ? s : act == NormGate::Swish ? z * s : 1.0f; };
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += double(px[g * d + j]) * px[g * d + j];
      const float r = float(1.0 / std::sqrt(s / double(d) + double(eps)));
      (*rstd)[size_t(g)] = r;
      for (int64_t j = 0; j < d; ++j) {
        const int64_t i = g * d + j;
        py[i] = px[i] * r * (pw ? pw[j] : 1.0f) * (pg ? actf(pg[i], sg[size_t(i)]) : 1.0f);
      }
    }
  });
  return make_node(std::move(y), {x, gate, w}, [x, gate, w, rstd, G, d, act, actf](Node& self) {
    const float* dy = self.grad.f32();
    const float* px2 = x->value.f32();
    const float* pw2 = w ? w->value.f32() : nullptr;
    const float* pg2 = gate ? gate->value.f32() : nullptr;
    float* dx = needs_grad(x) ? x->grad_f32() : nullptr;
    float* dgate = needs_grad(gate) ? gate->grad_f32() : nullptr;
    float* dw = needs_grad(w) ? w->grad_f32() : nullptr;
    const int64_t n_all = x->value.numel();
    std::vector<float> sg2(pg2 ? size_t(n_all) : 0);
    if (pg2) sigmoid_forward(pg2, sg2.data(), n_all);
    parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
      std::vector<float> dn(static_cast<size_t>(d));
      for (int64_t g = g0; g < g1; ++g) {
        const float r = (*rstd)[size_t(g)];
        double dot = 0;
        for (int64_t j = 0; j < d; ++j) {
          const int64_t i = g * d + j;
          const float n = px2[i] * r;
          const float wj = pw2 ? pw2[j] : 1.0f;
          const float a = pg2 ? actf(pg2[i], sg2[size_t(i)]) : 1.0f;
          if (dgate) {
            const float sgi = sg2[size_t(i)];
            const float da = act == NormGate::Sigmoid ? sgi * (1 - sgi) : sgi * (1 + pg2[i] * (1 - sgi));
            dgate[i] += dy[i] * n * wj * da;
          }
          dn[size_t(j)] = dy[i] * wj * a;
          dot += double(dn[size_t(j)]) * n;
        }
        if (dx) {
          const float m = float(dot / double(d));
          for (int64_t j = 0; j < d; ++j) dx[g * d + j] += r * (dn[size_t(j)] - px2[g * d + j] * r * m);
        }
      }
    });
    if (dw)  // a reduction over the groups: serial, rows in order
      for (int64_t g = 0; g < G; ++g) {
        const float r = (*rstd)[size_t(g)];
        for (int64_t j = 0; j < d; ++j) {
          const int64_t i = g * d + j;
          dw[j] += dy[i] * (px2[i] * r) * (pg2 ? actf(pg2[i], sg2[size_t(i)]) : 1.0f);
        }
      }
  }, "gated_rmsnorm");
}

}  // namespace k3::ag
