// CUDA forms of the delta-rule layer's differentiable ops (ag_delta.h), forward only: the
// recurrent kernel of delta_cuda.cu over B whole sequences, and the KDA gates. Dispatched from
// ag_delta.cc when the inputs live on the device (ops/ag_cuda.h).
#include "mixers/linear/ag_delta_cuda.h"

#include "core/device.h"
#include "mixers/linear/delta_cuda.h"
#include "ops/ag_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::ag::gpu {

Var delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const linear::DeltaOptions& opts,
               const DeltaShape& s) {
  using namespace linear;
  if (opts.normalize == Normalize::On)
    throw error("delta_rule", "the normalised linear attention has no CUDA form in models yet");
  linear::cuda::check_supported(s.K, s.V);
  std::vector<Var> parents = {q, k, v};
  linear::cuda::DeviceArgs a = linear::cuda::fp32_args(opts, s.H, s.HV, s.K, s.V);
  a.N = s.B;
  a.max_len = s.T;
  a.q = in(q, "delta_rule");
  a.k = in(k, "delta_rule");
  a.v = in(v, "delta_rule");
  if (opts.write == Write::Delta) {
    K3_CHECK(beta, "delta_rule: the delta write needs beta");
    a.beta = in(beta, "delta_rule");
    parents.push_back(beta);
  }
  if (opts.decay != Decay::None) {
    K3_CHECK(g, "delta_rule: a decay needs g");
    a.g = in(g, "delta_rule");
    parents.push_back(g);
  }
  const int64_t rows = s.B * s.T;
  K3_CHECK(q->value.numel() == rows * s.H * s.K && k->value.numel() == q->value.numel() &&
               v->value.numel() == rows * s.HV * s.V && (!a.beta || beta->value.numel() == rows * s.HV) &&
               (opts.decay != Decay::Scalar || g->value.numel() == rows * s.HV) &&
               (opts.decay != Decay::PerChannel || g->value.numel() == rows * s.HV * s.K),
           "delta_rule: q ", q->value.describe(), " k ", k->value.describe(), " v ", v->value.describe(),
           " (with beta / g) do not fit B=", s.B, " T=", s.T, " H=", s.H, " HV=", s.HV, " K=", s.K, " V=", s.V);
  std::vector<int64_t> row0(size_t(s.B)), len(size_t(s.B), s.T);
  for (int64_t b = 0; b < s.B; ++b) row0[size_t(b)] = b * s.T;
  const device::Buffer d_row0 = device::upload_new(row0.data(), row0.size() * 8);
  const device::Buffer d_len = device::upload_new(len.data(), len.size() * 8);
  a.row0 = d_row0.as<int64_t>();
  a.len = d_len.as<int64_t>();
  Tensor o = empty({s.B * s.T, s.HV * s.V});
  a.o = o.cuda_f32();
  linear::cuda::forward(a);
  forward_only("delta_rule", parents);
  return constant(std::move(o));
}

Var kda_gate(const Var& x, const Var& A_log, const Var& dt_bias, int64_t H, int64_t K, KdaGateForm form,
             float lower_bound) {
  const int64_t M = x->value.numel() / std::max<int64_t>(1, H * K);  // shapes checked by ag::kda_gate
  const GateShape gs{M, H, K};
  Tensor y = empty(x->value.shape());
  if (form == KdaGateForm::Softplus)
    k3::cuda::gate_softplus_forward(in(x, "kda_gate"), in(A_log, "kda_gate"), in(dt_bias, "kda_gate"), y.cuda_f32(), gs);
  else
    k3::cuda::gate_lowerbound_forward(in(x, "kda_gate"), in(A_log, "kda_gate"), in(dt_bias, "kda_gate"), lower_bound,
                                      y.cuda_f32(), gs);
  forward_only("kda_gate", {x, A_log, dt_bias});
  return constant(std::move(y));
}

}  // namespace k3::ag::gpu
