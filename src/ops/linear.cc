#include "ops/linear.h"

#include "core/device.h"

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

std::vector<Var> apply_each(const std::vector<const Linear*>& ls, const Var& x) {
  bool grouped = device::kCudaBuilt && ls.size() > 1 && x->value.device() == Device::CUDA && x->value.dtype() == DType::F32 &&
                 x->value.is_contiguous() && !(recording() && needs_grad(x));
  for (const Linear* l : ls)
    grouped = grouped && !l->bias && l->layout == WeightLayout::OutIn && !(recording() && needs_grad(l->weight)) &&
              l->weight->value.dtype() == ls[0]->weight->value.dtype() &&
              (l->weight->value.dtype() == DType::F32 || l->weight->value.dtype() == DType::BF16) &&
              l->weight->value.device() == Device::CUDA &&
              l->weight->value.ndim() == 2 && l->weight->value.dim(1) == x->value.dim(-1);
  if (grouped) {
    std::vector<const Tensor*> ws;
    for (const Linear* l : ls) ws.push_back(&l->weight->value);
    std::vector<Var> out;
    for (Tensor& y : linear::grouped(x->value, ws)) out.push_back(constant(std::move(y)));
    return out;
  }
  std::vector<Var> out;
  for (const Linear* l : ls) out.push_back((*l)(x));
  return out;
}

Norm::Norm(NormType t, int64_t d, float e, NormWeight w) : type(t), dim(d), eps(e), weight_form(w) {
  K3_CHECK(w == NormWeight::Plain || t == NormType::RMSNorm, "a zero-centred weight is an RMSNorm's");
  weight = parameter({d});
  if (t == NormType::LayerNorm) bias = parameter({d});
}

Var Norm::operator()(const Var& x) const {
  if (type == NormType::LayerNorm) return ag::layernorm(x, weight, bias, eps);
  // x̂·(1 + w) as x̂·w + x̂: the norm's own ops on either device, no constant of ones to keep.
  if (weight_form == NormWeight::ZeroCentred) return ag::add(ag::rmsnorm(x, weight, eps), ag::rmsnorm(x, nullptr, eps));
  return ag::rmsnorm(x, weight, eps);
}

void Norm::visit(const std::string& prefix, const ParamVisitor& v) const {
  // A zero-centred weight starts at 0 (init_normal sets Other to zero, Norm to one).
  v(join_name(prefix, "weight"), *weight, weight_form == NormWeight::ZeroCentred ? ParamKind::Other : ParamKind::Norm);
  if (bias) v(join_name(prefix, "bias"), *bias, ParamKind::Norm);
}

}  // namespace k3
