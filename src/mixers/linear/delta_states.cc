#include "mixers/linear/delta_states.h"

#include <cstring>

#include "core/device.h"
#include "core/profile.h"
#include "mixers/linear/ag_delta.h"
#include "mixers/linear/recurrent_state.h"
#include "mixers/mixers_cuda.h"
#include "ops/ag.h"
#include "ops/ag_conv.h"
#include "ops/ag_norms.h"

namespace k3::linear {

namespace {

RecurrentState* host_state(Memory* const* memories, int64_t b) {
  auto* s = dynamic_cast<RecurrentState*>(memories[b]);
  K3_CHECK(s && s->device() == Device::CPU, "delta layer: sequence ", b, "'s memory is not a host RecurrentState");
  return s;
}

Tensor delta_host(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                  const DeltaOptions& c, const DeltaBatch& s, Memory* const* memories) {
  const int64_t B = s.B, T = s.T, SS = s.HV * s.K * s.V, ZS = s.HV * s.K;
  const bool normalize = c.normalize == Normalize::On;
  std::vector<RecurrentState*> mems(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) mems[size_t(b)] = host_state(memories, b);
  DeltaInputs in;
  in.q = q.reshape({B, T, s.H, s.K});
  in.k = k.reshape({B, T, s.H, s.K});
  in.v = v.reshape({B, T, s.HV, s.V});
  if (c.write == Write::Delta) in.beta = beta.reshape({B, T, s.HV});
  if (c.decay == Decay::Scalar) in.g = g.reshape({B, T, s.HV});
  if (c.decay == Decay::PerChannel) in.g = g.reshape({B, T, s.HV, s.K});
  Tensor o;
  if (T == 1) {  // the decode step updates each sequence's state where it lives
    DeltaState st;
    for (RecurrentState* mem : mems) {
      st.S_seq.push_back(mem->state());
      if (normalize) st.z_seq.push_back(mem->normalizer());
    }
    o = delta_step(in, st, c);
  } else {  // a continued prefill: the chunked core takes the states as one batch (h0) and returns them
    Tensor S = Tensor::empty({B, s.HV, s.K, s.V});
    Tensor z = normalize ? Tensor::empty({B, s.HV, s.K}) : Tensor();
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(S.f32() + b * SS, mems[size_t(b)]->state(), static_cast<size_t>(SS) * sizeof(float));
      if (normalize) std::memcpy(z.f32() + b * ZS, mems[size_t(b)]->normalizer(), static_cast<size_t>(ZS) * sizeof(float));
    }
    in.h0 = S;
    in.z0 = z;
    DeltaOutputs out = delta_forward(in, c, Impl::Chunked);
    o = out.o;
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(mems[size_t(b)]->state(), out.ht.f32() + b * SS, static_cast<size_t>(SS) * sizeof(float));
      if (normalize)
        std::memcpy(mems[size_t(b)]->normalizer(), out.zt.f32() + b * ZS, static_cast<size_t>(ZS) * sizeof(float));
    }
  }
  for (RecurrentState* mem : mems) mem->advance(T);
  return o.reshape({B * T, s.HV * s.V});
}

}  // namespace

void check_state_step(Device device, int64_t K, int64_t V) {
  if (device == Device::CUDA) {
    if constexpr (device::kCudaBuilt) cuda::check_supported(K, V);
  }
}

std::vector<Tensor> convs_with_tails(const std::vector<Tensor>& xs, const std::vector<Tensor>& ws, int64_t B, int64_t T,
                                     int64_t W, bool silu, Memory* const* memories) {
  profile::Scope scope("short conv");
  K3_CHECK(!xs.empty() && ws.size() == xs.size(), "short_conv: ", xs.size(), " streams, ", ws.size(), " weights");
  if (xs[0].device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) return gpu::convs_with_tails(xs, ws, B, T, W, silu, memories);
  }
  std::vector<RecurrentState*> mems(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) mems[size_t(b)] = host_state(memories, b);
  std::vector<Tensor> ys;
  for (size_t s = 0; s < xs.size(); ++s) {
    const int64_t C = xs[s].dim(-1);
    K3_CHECK(xs[s].numel() == B * T * C && ws[s].numel() == C * W && W >= 1, "short_conv: stream ", s, " x ",
             xs[s].describe(), " weight ", ws[s].describe(), " for B=", B, " T=", T, " width ", W);
    Tensor x = xs[s].is_contiguous() ? xs[s] : xs[s].clone();
    Tensor y = Tensor::empty(x.shape());
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x.f32() + b * T * C;
      float* tail = W > 1 ? mems[size_t(b)]->conv_tail(s) : nullptr;
      short_conv_forward(xb, ws[s].f32(), tail, T, C, W, y.f32() + b * T * C);
      if (tail) short_conv_update_tail(xb, T, C, W, tail);
    }
    ys.push_back(silu ? ag::silu(constant(y))->value : y);
  }
  return ys;
}

Tensor delta_with_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                         const DeltaOptions& opts, const DeltaBatch& s, Memory* const* memories,
                         const DecodeActivations* act) {
  profile::Scope scope("state step");
  if (q.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) return gpu::delta_with_states(q, k, v, beta, g, opts, s, memories, act);
  }
  if (!act) return delta_host(q, k, v, beta, g, opts, s, memories);
  // The activations as the layer's own ops compute them, then the step.
  K3_CHECK(s.T == 1, "delta_rule: the fused activations are for the decode step (T = 1), got T = ", s.T);
  Tensor qa = q, ka = k, ba = beta, ga = g;
  if (act->l2norm) {
    qa = ag::l2norm(constant(q), s.K)->value;
    ka = ag::l2norm(constant(k), s.K)->value;
  }
  if (act->beta_logit && opts.write == Write::Delta) ba = ag::sigmoid(constant(beta))->value;
  if (act->gate != cuda::GateInput::LogDecay && opts.decay != Decay::None) {
    const int64_t per_head = opts.decay == Decay::PerChannel ? s.K : 1;
    const ag::KdaGateForm form =
        act->gate == cuda::GateInput::LowerBound ? ag::KdaGateForm::LowerBound : ag::KdaGateForm::Softplus;
    ga = ag::kda_gate(constant(g), constant(act->A_log), constant(act->dt_bias), s.HV, per_head, form,
                      act->lower_bound)->value;
  }
  return delta_host(qa, ka, v, ba, ga, opts, s, memories);
}

}  // namespace k3::linear
