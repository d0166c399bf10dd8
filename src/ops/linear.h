// Linear and Norm modules: parameters (named by their Hugging Face names) + a differentiable
// forward built from ag ops.
#pragma once

#include "ops/ag.h"
#include "ops/param.h"

namespace k3 {

enum class Bias : uint8_t { None, Present };

struct Linear {
  int64_t in = 0, out = 0;
  WeightLayout layout = WeightLayout::OutIn;
  Var weight;  // [out, in] or [in, out]
  Var bias;    // [out] or null

  Linear() = default;
  Linear(int64_t in_features, int64_t out_features, Bias b, WeightLayout l = WeightLayout::OutIn);
  Var operator()(const Var& x) const { return ag::linear(x, weight, bias, layout); }
  void visit(const std::string& prefix, const ParamVisitor& v) const;
  int64_t params() const { return in * out + (bias ? out : 0); }
};

enum class NormType : uint8_t { LayerNorm, RMSNorm };

// ls[i](x) for every i. On the device, with no gradient wanted of x or any weight and every weight
// bias-free [out, in] of one dtype, one grouped GEMM (one launch instead of one per projection:
// the decode step is bound by its launches); otherwise the linears one by one.
std::vector<Var> apply_each(const std::vector<const Linear*>& ls, const Var& x);

// Zero-centred (Qwen3-Next's RMSNorm): the stored weight w scales by (1 + w), so it starts at 0.
enum class NormWeight : uint8_t { Plain, ZeroCentred };

struct Norm {
  NormType type = NormType::LayerNorm;
  int64_t dim = 0;
  float eps = 1e-5f;
  NormWeight weight_form = NormWeight::Plain;  // RMSNorm only
  Var weight, bias;  // bias only for LayerNorm

  Norm() = default;
  Norm(NormType t, int64_t d, float e, NormWeight w = NormWeight::Plain);
  Var operator()(const Var& x) const;
  void visit(const std::string& prefix, const ParamVisitor& v) const;
};

}  // namespace k3
