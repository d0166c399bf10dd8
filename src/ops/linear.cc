#include "ops/linear.h"

namespace k3 {

Linear::Linear(int64_t in_features, int64_t out_features, Bias b, WeightLayout l)
    : in(in_features), out(out_features), layout(l) {
  weight = Tensor::meta(l == WeightLayout::OutIn ? Shape{out, in} : Shape{in, out});
  if (b == Bias::Present) bias = Tensor::meta({out});
}

void Linear::visit(const std::string& prefix, const ParamVisitor& v) {
  v(join_name(prefix, "weight"), weight, ParamKind::Weight);
  if (bias.defined()) v(join_name(prefix, "bias"), bias, ParamKind::Bias);
}

Norm::Norm(NormType t, int64_t d, float e) : type(t), dim(d), eps(e) {
  weight = Tensor::meta({d});
  if (t == NormType::LayerNorm) bias = Tensor::meta({d});
}

void Norm::forward(const float* x, int64_t M, float* y) const {
  if (type == NormType::LayerNorm)
    layernorm_forward(x, weight.f32(), bias.f32(), eps, M, dim, y);
  else
    rmsnorm_forward(x, weight.f32(), eps, M, dim, y);
}

void Norm::visit(const std::string& prefix, const ParamVisitor& v) {
  v(join_name(prefix, "weight"), weight, ParamKind::Norm);
  if (bias.defined()) v(join_name(prefix, "bias"), bias, ParamKind::Norm);
}

}  // namespace k3
