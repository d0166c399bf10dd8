// Finite-difference gradient checks for differentiable ops and modules (tests only).
#pragma once

#include <cmath>
#include <functional>
#include <vector>

#include "core/random.h"
#include "ops/ag.h"

namespace k3::testing {

inline Var random_var(Shape shape, Rng& rng, float scale = 1.0f, bool requires_grad = true) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = scale * rng.normal();
  Var v = constant(std::move(t));
  v->requires_grad = requires_grad;
  return v;
}

// Compares d/dx Σ w ⊙ f(inputs) from backward with central differences, for every input that
// requires grad (up to `max_coords` coordinates each). Returns the worst relative L2 error
// ‖g_fd − g‖ / ‖g‖ over the inputs. f runs in fp32, the loss sums in double.
inline double gradcheck(const std::function<Var(const std::vector<Var>&)>& f, const std::vector<Var>& inputs,
                        float step = 1e-2f, int64_t max_coords = 64, uint64_t seed = 1) {
  Rng rng(seed);
  Tensor w;
  auto loss_value = [&]() {
    Var y = f(inputs);
    if (!w.defined()) {
      w = Tensor::empty(y->value.shape());
      for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = rng.normal();
    }
    double s = 0;
    for (int64_t i = 0; i < w.numel(); ++i) s += double(w.f32()[i]) * y->value.f32()[i];
    return s;
  };
  for (const auto& v : inputs) v->grad = Tensor();
  {
    Recording rec;
    Var y = f(inputs);
    if (!w.defined()) {
      w = Tensor::empty(y->value.shape());
      for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = rng.normal();
    }
    backward(y, w);
  }
  double worst = 0;
  for (const auto& v : inputs) {
    if (!v->requires_grad) continue;
    const int64_t n = v->value.numel();
    const int64_t stride = std::max<int64_t>(1, n / max_coords);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i += stride) {
      float* x = v->value.f32() + i;
      const float x0 = *x;
      const float h = step * std::max(1.0f, std::fabs(x0));
      *x = x0 + h;
      double lp = loss_value();
      *x = x0 - h;
      double lm = loss_value();
      *x = x0;
      double fd = (lp - lm) / (2.0 * double(h));
      double an = v->grad.defined() ? v->grad.f32()[i] : 0.0;
      num += (fd - an) * (fd - an);
      den += an * an;
    }
    worst = std::max(worst, std::sqrt(num) / std::max(std::sqrt(den), 1e-12));
  }
  return worst;
}

}  // namespace k3::testing
