#include "ops/situ.h"

#include "ops/ag_cuda.h"

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
  K3_AG_CUDA(gate, situ_glu(gate, up, opts));
  if (gate->value.shape() != up->value.shape())
    throw error("situ", "gate ", gate->value.describe(), " and up ", up->value.describe(), " differ in shape");
  Tensor y = Tensor::empty(gate->value.shape());
  // The array kernels take a cap ≤ 0 as "absent".
  const float beta = opts.beta ? *opts.beta : 0.0f, beta_lin = opts.beta_lin ? *opts.beta_lin : 0.0f;
  if ((opts.beta && !(beta > 0)) || (opts.beta_lin && !(beta_lin > 0)))
    throw error("situ", "the caps must be positive: beta ", beta, ", beta_lin ", beta_lin);
  situ_glu_forward(gate->value.f32(), up->value.f32(), y.f32(), y.numel(), beta, beta_lin);
  return make_node(std::move(y), {gate, up}, [gate, up, beta, beta_lin](Node& self) {
    const int64_t n = self.value.numel();
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
