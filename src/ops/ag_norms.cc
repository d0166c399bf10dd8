#include "ops/ag_norms.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/parallel.h"
#include "ops/activation.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

namespace k3::ag {

namespace {
// Groups per parallel chunk: about 4K elements.
int64_t grain(int64_t d) { return std::max<int64_t>(1, 4096 / d); }
int64_t groups(const Var& x, int64_t d, const char* op) {
  K3_CHECK(d > 0 && x->value.numel() % d == 0 && x->value.dim(-1) % d == 0, op, ": ", x->value.describe(),
           " is not made of heads of ", d);
  return x->value.numel() / d;
}

// The host forms of the two norms: forward (saving 1/‖x‖ or rstd per group) and backward.
void l2norm_host(const float* px, float* py, float* rinv, int64_t G, int64_t d, float eps) {
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += double(px[g * d + j]) * px[g * d + j];
      const float r = float(1.0 / std::sqrt(s + double(eps)));
      rinv[g] = r;
      for (int64_t j = 0; j < d; ++j) py[g * d + j] = px[g * d + j] * r;
    }
  });
}

void l2norm_host_backward(const float* yv, const float* rinv, const float* dy, float* dx, int64_t G, int64_t d) {
  // dx = r (dy − y (y·dy))
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      double dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += double(yv[g * d + j]) * dy[g * d + j];
      const float r = rinv[g];
      for (int64_t j = 0; j < d; ++j) dx[g * d + j] += r * (dy[g * d + j] - yv[g * d + j] * float(dot));
    }
  });
}

float gate_of(NormGate act, float z, float s) { return act == NormGate::Sigmoid ? s : act == NormGate::Swish ? z * s : 1.0f; }

void gated_rmsnorm_host(const float* px, const float* pg, const float* pw, float* py, float* rstd, int64_t G, int64_t d,
                        float eps, NormGate act) {
  // σ(gate) once, vectorised (the gate's activation and its derivative both come from it).
  std::vector<float> sg(pg ? size_t(G * d) : 0);
  if (pg) sigmoid_forward(pg, sg.data(), G * d);
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += double(px[g * d + j]) * px[g * d + j];
      const float r = float(1.0 / std::sqrt(s / double(d) + double(eps)));
      rstd[g] = r;
      for (int64_t j = 0; j < d; ++j) {
        const int64_t i = g * d + j;
        py[i] = px[i] * r * (pw ? pw[j] : 1.0f) * (pg ? gate_of(act, pg[i], sg[size_t(i)]) : 1.0f);
      }
    }
  });
}

void gated_rmsnorm_host_backward(const float* px2, const float* pg2, const float* pw2, const float* rstd,
                                 const float* dy, float* dx, float* dgate, float* dw, int64_t G, int64_t d,
                                 NormGate act) {
  const int64_t n_all = G * d;
  std::vector<float> sg2(pg2 ? size_t(n_all) : 0);
  if (pg2) sigmoid_forward(pg2, sg2.data(), n_all);
  parallel_for(G, grain(d), [&](int64_t g0, int64_t g1) {
    std::vector<float> dn(static_cast<size_t>(d));
    for (int64_t g = g0; g < g1; ++g) {
      const float r = rstd[g];
      double dot = 0;
      for (int64_t j = 0; j < d; ++j) {
        const int64_t i = g * d + j;
        const float n = px2[i] * r;
        const float wj = pw2 ? pw2[j] : 1.0f;
        const float a = pg2 ? gate_of(act, pg2[i], sg2[size_t(i)]) : 1.0f;
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
      const float r = rstd[g];
      for (int64_t j = 0; j < d; ++j) {
        const int64_t i = g * d + j;
        dw[j] += dy[i] * (px2[i] * r) * (pg2 ? gate_of(act, pg2[i], sg2[size_t(i)]) : 1.0f);
      }
    }
}

// The CUDA kernels recompute the norms in the backward; the host keeps them (saved, [G]).
float* host(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }
#if defined(K3_HAS_CUDA)
float* dev(const Tensor& t) { return t.defined() ? t.cuda_f32() : nullptr; }
int act_code(NormGate act) { return act == NormGate::Sigmoid ? 1 : act == NormGate::Swish ? 2 : 0; }
#endif
void same_device(const char* op, const Tensor& x, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->device() != x.device())
      throw error(op, x.describe(), " is on ", device_words(x.device()), " but ", t->describe(), " is on ",
                  device_words(t->device()));
}
}  // namespace

Var l2norm(const Var& x, int64_t d, float eps) {
  const int64_t G = groups(x, d, "l2norm");
  const Device dev_ = x->value.device();
  Tensor y = Tensor::empty_on(dev_, x->value.shape());
  const Tensor rinv = dev_ == Device::CPU ? Tensor::empty({G}) : Tensor();
  if (dev_ == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    cuda::l2norm_groups(x->value.cuda_f32(), y.cuda_f32(), G, d, eps);
#endif
  } else {
    l2norm_host(x->value.f32(), y.f32(), rinv.f32(), G, d, eps);
  }
  return make_node(std::move(y), {x}, [x, rinv, G, d, eps](Node& self) {
    same_device("l2norm", x->value, {&self.grad});
    if (x->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
      return cuda::l2norm_groups_backward(x->value.cuda_f32(), self.grad.cuda_f32(), x->grad_cuda(), G, d, eps);
#endif
    }
    l2norm_host_backward(self.value.f32(), rinv.f32(), self.grad.f32(), x->grad_f32(), G, d);
  }, "l2norm");
}

Var gated_rmsnorm(const Var& x, const Var& gate, const Var& w, int64_t d, float eps, NormGate act) {
  const int64_t G = groups(x, d, "gated_rmsnorm");
  K3_CHECK((act == NormGate::None) == !gate, "gated_rmsnorm: a gate needs an activation and vice versa");
  if (gate) K3_CHECK(gate->value.shape() == x->value.shape(), "gated_rmsnorm: gate ", gate->value.describe(), " vs x ", x->value.describe());
  if (w) K3_CHECK(w->value.numel() == d, "gated_rmsnorm: weight ", w->value.describe(), " for heads of ", d);
  const Tensor gv = gate ? gate->value : Tensor(), wv = w ? w->value : Tensor();
  same_device("gated_rmsnorm", x->value, {&gv, &wv});
  const Device dev_ = x->value.device();
  Tensor y = Tensor::empty_on(dev_, x->value.shape());
  const Tensor rstd = dev_ == Device::CPU ? Tensor::empty({G}) : Tensor();
  if (dev_ == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    cuda::gated_rmsnorm_groups(x->value.cuda_f32(), dev(gv), dev(wv), y.cuda_f32(), G, d, eps, act_code(act));
#endif
  } else {
    gated_rmsnorm_host(x->value.f32(), host(gv), host(wv), y.f32(), rstd.f32(), G, d, eps, act);
  }
  return make_node(std::move(y), {x, gate, w}, [x, gate, w, rstd, G, d, eps, act](Node& self) {
    const Tensor dx = needs_grad(x) ? x->grad_tensor() : Tensor();
    const Tensor dgate = needs_grad(gate) ? gate->grad_tensor() : Tensor();
    const Tensor dw = needs_grad(w) ? w->grad_tensor() : Tensor();
    const Tensor gv2 = gate ? gate->value : Tensor(), wv2 = w ? w->value : Tensor();
    if (x->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
      return cuda::gated_rmsnorm_groups_backward(x->value.cuda_f32(), dev(gv2), dev(wv2), self.grad.cuda_f32(), dev(dx),
                                                 dev(dgate), dev(dw), G, d, eps, act_code(act));
#endif
    }
    gated_rmsnorm_host_backward(x->value.f32(), host(gv2), host(wv2), rstd.f32(), self.grad.f32(), host(dx),
                                host(dgate), host(dw), G, d, act);
  }, "gated_rmsnorm");
}

}  // namespace k3::ag
