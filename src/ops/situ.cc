#include "ops/situ.h"

#include "ops/ag_cuda.h"

#include <cmath>

#include "core/parallel.h"

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
  const float *pg = gate->value.f32(), *pu = up->value.f32();
  float* py = y.f32();
  const int64_t n = y.numel();
  const auto beta = opts.beta, beta_lin = opts.beta_lin;
  parallel_for(n, 1 << 14, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) py[i] = situ_gate(pg[i], beta) * situ_up(pu[i], beta_lin);
  });
  return make_node(std::move(y), {gate, up}, [gate, up, beta, beta_lin](Node& self) {
    const float* g = self.grad.f32();
    const float *xg = gate->value.f32(), *xu = up->value.f32();
    float* dg = needs_grad(gate) ? gate->grad_f32() : nullptr;
    float* du = needs_grad(up) ? up->grad_f32() : nullptr;
    const int64_t m = self.value.numel();
    parallel_for(m, 1 << 14, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) {
        if (dg) dg[i] += g[i] * situ_gate_grad(xg[i], beta) * situ_up(xu[i], beta_lin);
        if (du) du[i] += g[i] * situ_gate(xg[i], beta) * situ_up_grad(xu[i], beta_lin);
      }
    });
  }, opts.beta || opts.beta_lin ? "situ_glu" : "silu_glu");
}

Var silu_glu(const Var& gate, const Var& up) { return situ_glu(gate, up, SituOptions::silu()); }

}  // namespace ag
}  // namespace k3
