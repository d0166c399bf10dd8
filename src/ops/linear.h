// Linear and Norm modules: parameters + forward, named by their Hugging Face names.
#pragma once

#include "ops/gemm.h"
#include "ops/norm.h"
#include "ops/param.h"

namespace k3 {

enum class Bias : uint8_t { None, Present };

struct Linear {
  int64_t in = 0, out = 0;
  WeightLayout layout = WeightLayout::OutIn;
  Tensor weight;  // [out, in] or [in, out]
  Tensor bias;    // [out] or undefined

  Linear() = default;
  Linear(int64_t in_features, int64_t out_features, Bias b, WeightLayout l = WeightLayout::OutIn);
  // y[M, out] = x[M, in] W + b (+ beta * y)
  void forward(const float* x, int64_t M, float* y, float beta = 0.0f) const {
    linear_forward(x, M, in, out, weight, layout, bias.defined() ? bias.f32() : nullptr, y, beta);
  }
  void visit(const std::string& prefix, const ParamVisitor& v);
  int64_t params() const { return in * out + (bias.defined() ? out : 0); }
};

enum class NormType : uint8_t { LayerNorm, RMSNorm };

struct Norm {
  NormType type = NormType::LayerNorm;
  int64_t dim = 0;
  float eps = 1e-5f;
  Tensor weight, bias;  // bias only for LayerNorm

  Norm() = default;
  Norm(NormType t, int64_t d, float e);
  void forward(const float* x, int64_t M, float* y) const;
  void visit(const std::string& prefix, const ParamVisitor& v);
};

}  // namespace k3
