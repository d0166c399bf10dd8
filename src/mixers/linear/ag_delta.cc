#include "mixers/linear/ag_delta.h"

#include "mixers/linear/ag_delta_cuda.h"
#include "ops/ag_cuda.h"
#include "ops/gates.h"

namespace k3::ag {

namespace {
void accumulate(const Var& x, const Tensor& g) {
  if (!needs_grad(x) || !g.defined()) return;
  float* d = x->grad_f32();
  const float* s = g.f32();
  for (int64_t i = 0; i < g.numel(); ++i) d[i] += s[i];
}
}  // namespace

Var delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const linear::DeltaOptions& opts,
               const DeltaShape& s) {
  K3_AG_CUDA(q, delta_rule(q, k, v, beta, g, opts, s));
  using namespace linear;
  auto inputs = [=]() {
    DeltaInputs in;
    in.q = q->value.reshape({s.B, s.T, s.H, s.K});
    in.k = k->value.reshape({s.B, s.T, s.H, s.K});
    in.v = v->value.reshape({s.B, s.T, s.HV, s.V});
    if (opts.write == Write::Delta) {
      K3_CHECK(beta, "delta_rule: the delta write needs beta");
      in.beta = beta->value.reshape({s.B, s.T, s.HV});
    }
    if (opts.decay == Decay::Scalar) {
      K3_CHECK(g, "delta_rule: a scalar decay needs g");
      in.g = g->value.reshape({s.B, s.T, s.HV});
    } else if (opts.decay == Decay::PerChannel) {
      K3_CHECK(g, "delta_rule: a per-channel decay needs g");
      in.g = g->value.reshape({s.B, s.T, s.HV, s.K});
    }
    return in;
  };
  DeltaOutputs out = delta_forward(inputs(), opts, Impl::Chunked);
  Tensor o = out.o.reshape({s.B * s.T, s.HV * s.V});
  std::vector<Var> parents = {q, k, v};
  if (opts.write == Write::Delta) parents.push_back(beta);
  if (opts.decay != Decay::None) parents.push_back(g);
  return make_node(std::move(o), std::move(parents), [=](Node& self) {
    DeltaCotangents cot;
    cot.d_o = self.grad.reshape({s.B, s.T, s.HV, s.V});
    DeltaGrads gr = delta_backward(inputs(), cot, opts, Impl::Chunked);
    accumulate(q, gr.dq);
    accumulate(k, gr.dk);
    accumulate(v, gr.dv);
    if (opts.write == Write::Delta) accumulate(beta, gr.dbeta);
    if (opts.decay != Decay::None) accumulate(g, gr.dg);
  }, "delta_rule");
}

Var kda_gate(const Var& x, const Var& A_log, const Var& dt_bias, int64_t H, int64_t K, KdaGateForm form,
             float lower_bound) {
  const int64_t M = x->value.numel() / std::max<int64_t>(1, H * K);
  K3_CHECK(x->value.numel() == M * H * K && x->value.dim(-1) == H * K, "kda_gate: x ", x->value.describe(), " for H=", H,
           " K=", K);
  K3_CHECK(A_log->value.numel() >= H, "kda_gate: A_log ", A_log->value.describe(), " has fewer than ", H, " values");
  K3_CHECK(dt_bias->value.numel() == H * K, "kda_gate: dt_bias ", dt_bias->value.describe(), " for H*K = ", H * K);
  K3_AG_CUDA(x, kda_gate(x, A_log, dt_bias, H, K, form, lower_bound));
  const GateShape gs{M, H, K};
  Tensor y = Tensor::empty(x->value.shape());
  if (form == KdaGateForm::Softplus)
    gate_softplus_forward(x->value.f32(), A_log->value.f32(), dt_bias->value.f32(), y.f32(), gs);
  else
    gate_lowerbound_forward(x->value.f32(), A_log->value.f32(), dt_bias->value.f32(), lower_bound, y.f32(), gs);
  return make_node(std::move(y), {x, A_log, dt_bias}, [=](Node& self) {
    float* dx = needs_grad(x) ? x->grad_f32() : nullptr;
    float* dA = needs_grad(A_log) ? A_log->grad_f32() : nullptr;
    float* db = needs_grad(dt_bias) ? dt_bias->grad_f32() : nullptr;
    if (form == KdaGateForm::Softplus)
      gate_softplus_backward(x->value.f32(), A_log->value.f32(), dt_bias->value.f32(), self.grad.f32(), dx, dA, db, gs);
    else
      gate_lowerbound_backward(x->value.f32(), A_log->value.f32(), dt_bias->value.f32(), lower_bound, self.grad.f32(),
                               dx, dA, db, gs);
  }, "kda_gate");
}

}  // namespace k3::ag
