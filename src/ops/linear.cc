#include "ops/linear.h"

namespace k3 {

Linear::Linear(int64_t in_features, int64_t out_features, Bias b, WeightLayout l)
    : in(in_features), out(out_features), layout(l) {
  weight = parameter(l == WeightLayout::OutIn ? Shape{out, in} : Shape{in, out});
  if (b == Bias::Present) bias = parameter({out});
}

void Linear::visit(const std::string& prefix, const ParamVisitor& v) const {
  v(join_name(prefix, "weight"), *weight, ParamKind::Weight);
  if (bias) v(join_name(prefix, "bias"), *bias, ParamKind::Bias);
}

Norm::Norm(NormType t, int64_t d, float e) : type(t), dim(d), eps(e) {
  weight = parameter({d});
  if (t == NormType::LayerNorm) bias = parameter({d});
}

Var Norm::operator()(const Var& x) const {
  return type == NormType::LayerNorm ? ag::layernorm(x, weight, bias, eps) : ag::rmsnorm(x, weight, eps);
}

void Norm::visit(const std::string& prefix, const ParamVisitor& v) const {
  v(join_name(prefix, "weight"), *weight, ParamKind::Norm);
  if (bias) v(join_name(prefix, "bias"), *bias, ParamKind::Norm);
}

}  // namespace k3
