// Test helper: one differentiable computation on host Vars and on their device copies, forward
// and backward, compared value by value (the CPU forms are tested against fixtures and finite
// differences elsewhere, so they are the reference here).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/random.h"
#include "ops/autograd.h"

namespace k3::testing {

inline Var rand_var(Rng& rng, Shape s, float scale = 1.0f) {
  Tensor t = Tensor::empty(std::move(s));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = scale * rng.normal();
  return constant(std::move(t));
}

inline double rel_diff(const Tensor& x, const Tensor& ref) {
  EXPECT_EQ(x.shape(), ref.shape());
  if (x.shape() != ref.shape()) return INFINITY;
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    if (!std::isfinite(x.f32()[i])) return INFINITY;
    num += std::pow(double(x.f32()[i]) - ref.f32()[i], 2);
    den += std::pow(double(ref.f32()[i]), 2);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Runs f on leaf copies of `inputs` that require grad, on the host and on the device, then
// backward from the same random cotangent. Returns the largest relative L2 difference over the
// output and every input's gradient; `what` names the worst one.
inline double compare_with_grads(const std::vector<Var>& inputs, const std::function<Var(const std::vector<Var>&)>& f,
                                 std::string* what = nullptr) {
  auto leaves = [&](Device dev) {
    std::vector<Var> out;
    for (const Var& v : inputs) {
      if (!v) {
        out.push_back(nullptr);
        continue;
      }
      Var l = constant(dev == Device::CPU ? v->value.clone() : v->value.to_device(dev));
      l->requires_grad = true;
      out.push_back(l);
    }
    return out;
  };
  std::vector<Var> host = leaves(Device::CPU), dev = leaves(Device::CUDA);
  Var ref, got;
  {
    Recording rec;
    ref = f(host);
    got = f(dev);
  }
  double worst = rel_diff(got->value.to_device(Device::CPU), ref->value);
  if (what) *what = "output";
  Rng rng(4242);
  Tensor seed = Tensor::empty(ref->value.shape());
  for (int64_t i = 0; i < seed.numel(); ++i) seed.f32()[i] = rng.normal();
  backward(ref, seed);
  backward(got, seed);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i]) continue;
    const bool has_ref = host[i]->grad.defined(), has_got = dev[i]->grad.defined();
    EXPECT_EQ(has_ref, has_got) << "input " << i << " gradient present on one device only";
    if (!has_ref || !has_got) continue;
    const double d = rel_diff(dev[i]->grad.to_device(Device::CPU), host[i]->grad);
    if (d > worst) {
      worst = d;
      if (what) *what = "gradient of input " + std::to_string(i);
    }
  }
  return worst;
}

}  // namespace k3::testing
