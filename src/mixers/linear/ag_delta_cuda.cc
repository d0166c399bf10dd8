// CUDA forms of the delta-rule layer's differentiable ops (ag_delta.h): the kernels of
// delta_cuda.cu over B whole sequences (forward, and under Recording the backward, which
// recomputes the states unless the forward kept its chunked scratch), and the KDA gates.
// Dispatched from ag_delta.cc when the inputs live on the device (ops/ag_cuda.h).
#include "mixers/linear/ag_delta_cuda.h"

#include <memory>

#include "core/device.h"
#include "mixers/linear/delta_cuda.h"
#include "ops/ag_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::ag::gpu {

// The most one delta-rule layer keeps from its forward to its backward (ForwardScratch).
constexpr size_t kKeptScratchBytes = size_t(256) << 20;

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
  auto d_seqs = std::make_shared<std::pair<device::Buffer, device::Buffer>>(
      device::upload_new(row0.data(), row0.size() * 8), device::upload_new(len.data(), len.size() * 8));
  a.row0 = d_seqs->first.as<int64_t>();
  a.len = d_seqs->second.as<int64_t>();
  Tensor o = empty({s.B * s.T, s.HV * s.V});
  a.o = o.cuda_f32();
  // Training: the chunked forward keeps its scratch for the backward where it is small, so the
  // backward skips recomputing it; larger ones are recomputed (bounded activation memory).
  std::shared_ptr<linear::cuda::ForwardScratch> keep;
  bool grads = false;
  for (const Var& p : parents) grads = grads || needs_grad(p);
  if (recording() && grads) {
    keep = std::make_shared<linear::cuda::ForwardScratch>();
    keep->budget = kKeptScratchBytes;
    a.keep = keep.get();
  }
  linear::cuda::forward(a);
  a.o = nullptr;
  return make_node(std::move(o), parents, [q, k, v, beta, g, a, d_seqs, keep, T = s.T](Node& self) {
    // The kernel writes every gradient it has into zeroed buffers (sums over value blocks and
    // grouped heads): scratch, then added to the inputs' gradients.
    auto zeroed = [](const Var& x) { return zeros(x->value.shape()); };
    Tensor dq = zeroed(q), dk = zeroed(k), dv = zeroed(v);
    Tensor dbeta = a.beta ? zeroed(beta) : Tensor(), dg = a.g ? zeroed(g) : Tensor();
    linear::cuda::DeviceGrads gr;
    gr.d_o = self.grad.cuda_f32();
    gr.do_dtype = DType::F32;
    gr.dq = dq.cuda_f32();
    gr.dk = dk.cuda_f32();
    gr.dv = dv.cuda_f32();
    gr.dbeta = a.beta ? dbeta.cuda_f32() : nullptr;
    gr.dg = a.g ? dg.cuda_f32() : nullptr;
    gr.longest = T;
    device::Buffer dh0(size_t(a.N * a.HV * a.K * a.V) * sizeof(float));  // the kernel writes dh0 unconditionally
    gr.dh0 = dh0.as<float>();
    linear::cuda::backward(a, gr);
    flush(q, dq);
    flush(k, dk);
    flush(v, dv);
    if (a.beta) flush(beta, dbeta);
    if (a.g) flush(g, dg);
  }, "delta_rule");
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
  return make_node(std::move(y), {x, A_log, dt_bias}, [x, A_log, dt_bias, form, lower_bound, gs](Node& self) {
    float* dx = needs_grad(x) ? x->grad_cuda() : nullptr;
    float* dA = needs_grad(A_log) ? A_log->grad_cuda() : nullptr;
    float* db = needs_grad(dt_bias) ? dt_bias->grad_cuda() : nullptr;
    if (form == KdaGateForm::Softplus)
      k3::cuda::gate_softplus_backward(x->value.cuda_f32(), A_log->value.cuda_f32(), dt_bias->value.cuda_f32(),
                                       self.grad.cuda_f32(), dx, dA, db, gs);
    else
      k3::cuda::gate_lowerbound_backward(x->value.cuda_f32(), A_log->value.cuda_f32(), dt_bias->value.cuda_f32(),
                                         lower_bound, self.grad.cuda_f32(), dx, dA, db, gs);
  }, "kda_gate");
}

}  // namespace k3::ag::gpu
