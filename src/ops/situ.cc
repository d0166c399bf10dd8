#include "ops/situ.h"

#include "core/error.h"
#include "ops/elementwise.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

#include <cmath>
#include <vector>

#include "ops/activation.h"

namespace k3 {

namespace {
inline float sigm(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

float situ_gate(float g, std::optional<float> beta) {
  const float s = sigm(g);
  return beta ? *beta * std::tanh(g / *beta) * s : g * s;
}

float situ_gate_grad(float g, std::optional<float> beta) {
  const float s = sigm(g);
  if (!beta) return s * (1.0f + g * (1.0f - s));
  // d/dg [β tanh(g/β) σ(g)] = (1 − tanh²(g/β))·σ(g) + β tanh(g/β)·σ(g)(1 − σ(g))
  const float t = std::tanh(g / *beta);
  return (1.0f - t * t) * s + *beta * t * s * (1.0f - s);
}

float situ_up(float u, std::optional<float> beta_lin) { return beta_lin ? *beta_lin * std::tanh(u / *beta_lin) : u; }

float situ_up_grad(float u, std::optional<float> beta_lin) {
  if (!beta_lin) return 1.0f;
  const float t = std::tanh(u / *beta_lin);
  return 1.0f - t * t;
}

namespace ag {

Var situ_glu(const Var& gate, const Var& up, const SituOptions& opts) {
  if (gate->value.shape() != up->value.shape())
    throw error("situ", "gate ", gate->value.describe(), " and up ", up->value.describe(), " differ in shape");
  if (gate->value.device() != up->value.device())
    throw error("situ", "gate ", gate->value.describe(), " is on ", device_words(gate->value.device()), " but up ",
                up->value.describe(), " is on ", device_words(up->value.device()));
  const bool cuda = gate->value.device() == Device::CUDA;
  Tensor y = Tensor::empty_on(gate->value.device(), gate->value.shape());
  // The kernels take a cap ≤ 0 as "absent".
  const float beta = opts.beta ? *opts.beta : 0.0f, beta_lin = opts.beta_lin ? *opts.beta_lin : 0.0f;
  if ((opts.beta && !(beta > 0)) || (opts.beta_lin && !(beta_lin > 0)))
    throw error("situ", "the caps must be positive: beta ", beta, ", beta_lin ", beta_lin);
  if (cuda) {
#if defined(K3_HAS_CUDA)
    cuda::situ_glu_forward(gate->value.cuda_f32(), up->value.cuda_f32(), y.cuda_f32(), y.numel(), beta, beta_lin,
                           device::Storage::F32);
#endif
  } else {
    situ_glu_forward(gate->value.f32(), up->value.f32(), y.f32(), y.numel(), beta, beta_lin);
  }
  return make_node(std::move(y), {gate, up}, [gate, up, beta, beta_lin, cuda](Node& self) {
    const int64_t n = self.value.numel();
    if (cuda) {
#if defined(K3_HAS_CUDA)
      // The kernel writes both gradients: into scratch, then added where wanted.
      const Tensor dg = Tensor::empty_on(Device::CUDA, gate->value.shape()), du = Tensor::empty_on(Device::CUDA, up->value.shape());
      cuda::situ_glu_backward(gate->value.cuda_f32(), up->value.cuda_f32(), self.grad.cuda_f32(), dg.cuda_f32(),
                              du.cuda_f32(), n, beta, beta_lin, device::Storage::F32);
      if (needs_grad(gate)) elementwise::accumulate(gate->grad_tensor(), dg);
      if (needs_grad(up)) elementwise::accumulate(up->grad_tensor(), du);
      return;
#endif
    }
    // Both gradients are computed together; the one not wanted (if any) goes to a scratch buffer.
    float* dg = needs_grad(gate) ? gate->grad_f32() : nullptr;
    float* du = needs_grad(up) ? up->grad_f32() : nullptr;
    std::vector<float> unused;
    if (!dg || !du) {
      unused.assign(size_t(n), 0.0f);
      (dg ? du : dg) = unused.data();
    }
    situ_glu_backward(gate->value.f32(), up->value.f32(), self.grad.f32(), dg, du, n, beta, beta_lin);
  }, opts.beta || opts.beta_lin ? "situ_glu" : "silu_glu");
}

Var silu_glu(const Var& gate, const Var& up) { return situ_glu(gate, up, SituOptions::silu()); }

}  // namespace ag
}  // namespace k3
