// Device memories and the cached forward paths of mixers_cuda.h.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/device.h"
#include "core/dtype.h"
#include "core/profile.h"
#include "mixers/attention/kv_cache.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/linear/recurrent_state.h"
#include "mixers/mla/mla.h"
#include "mixers/mixers_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::gpu {

namespace {

Tensor dev_empty(Shape s) { return Tensor::empty_on(Device::CUDA, std::move(s)); }

// A memory of kind M whose buffers live on the device.
template <class M>
M* device_memory(Memory* m, const char* who) {
  auto* d = dynamic_cast<M*>(m);
  if (!d) throw error(who, "a sequence's memory is of another kind (", memory_kind_name(m->kind()), ")");
  if (d->device() != Device::CUDA) throw error(who, "a host memory given to a model on CUDA (make contexts after move_to)");
  return d;
}
TokenRows* device_rows(Memory* m, const char* who) {
  if (m && m->kind() == MemoryKind::KVCache) return &device_memory<KVCache>(m, who)->rows();
  return &device_memory<LatentCache>(m, who)->rows();
}

}  // namespace

Tensor cached_attention(const Tensor& qkv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hd, float scale,
                        Memory* const* memories) {
  profile::Scope scope("cached attention");
  const int64_t D = H * hd, Dkv = Hkv * hd, W = D + 2 * Dkv, group = H / Hkv;
  K3_CHECK(qkv.numel() == B * T * W, "attention: qkv ", qkv.describe(), " for B=", B, " T=", T, " width ", W);
  // Every cache must take the new tokens before any changes: a failure leaves the batch intact.
  std::vector<TokenRows*> caches(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    caches[size_t(b)] = device_rows(memories[b], "attention");
    caches[size_t(b)]->reserve(T);
  }
  Tensor att = dev_empty({B * T, D});
  if (T == 1) {
    // A decode step: every sequence's key and value rows appended and attended over in one launch
    // each, through device tables of the caches (replayable: a replay finds the lengths moved on).
    std::vector<void*> ks(static_cast<size_t>(B)), vs(static_cast<size_t>(B));
    std::vector<int64_t> p0s(static_cast<size_t>(B));
    int64_t longest = 1;
    for (int64_t b = 0; b < B; ++b) {
      TokenRows* cache = caches[size_t(b)];
      ks[size_t(b)] = cache->raw(0), vs[size_t(b)] = cache->raw(1);
      p0s[size_t(b)] = cache->length();
      longest = std::max(longest, device::capturing() ? cache->capacity() : cache->length() + 1);
    }
    const device::Buffer d_ks = device::upload_new(ks.data(), ks.size() * sizeof(void*), device::Refresh::Constant);
    const device::Buffer d_vs = device::upload_new(vs.data(), vs.size() * sizeof(void*), device::Refresh::Constant);
    const device::Buffer d_p0s = device::upload_new(p0s.data(), p0s.size() * 8, device::Refresh::Advance);
    const float* base = qkv.cuda_f32();
    k3::cuda::append_rows(base + D, W, B, 1, Dkv, d_ks.as<void* const>(), d_p0s.as<int64_t>(), device::Storage::F32);
    k3::cuda::append_rows(base + D + Dkv, W, B, 1, Dkv, d_vs.as<void* const>(), d_p0s.as<int64_t>(),
                          device::Storage::F32);
    k3::cuda::attention_cached(base, W, d_ks.as<const void* const>(), d_vs.as<const void* const>(),
                               d_p0s.as<int64_t>(), longest, att.cuda_f32(), B, 1, H, hd, hd, scale,
                               device::Storage::F32, group);
    for (TokenRows* cache : caches) cache->advance(1);
    return att;
  }
  // A prefill: sequence by sequence through the flash kernels, each launch taking its cache's
  // length as a parameter (not replayable).
  if (device::capturing()) throw error("attention", "a KV-cache prefill cannot be captured in a graph");
  Tensor q = dev_empty({T, D});
  for (int64_t b = 0; b < B; ++b) {
    TokenRows* cache = caches[size_t(b)];
    const float* base = qkv.cuda_f32() + b * T * W;
    k3::cuda::copy_blocks(base, W, 0, q.cuda_f32(), D, 0, T, 1, D);
    cache->append(0, base + D, W, T);
    cache->append(1, base + D + Dkv, W, T);
    cache->advance(T);
    const int64_t S = cache->length();
    const float *k = cache->f32(0), *v = cache->f32(1);
    Tensor kx, vx;  // grouped-query attention: the cache's heads repeated for the flash kernels
    if (group > 1) {
      kx = dev_empty({S, D}), vx = dev_empty({S, D});
      for (int64_t j = 0; j < Hkv; ++j) {
        k3::cuda::copy_blocks(k + j * hd, Dkv, 0, kx.cuda_f32() + j * group * hd, D, hd, S, group, hd);
        k3::cuda::copy_blocks(v + j * hd, Dkv, 0, vx.cuda_f32() + j * group * hd, D, hd, S, group, hd);
      }
      k = kx.cuda_f32(), v = vx.cuda_f32();
    }
    const k3::cuda::AttnShape a{1, T, S, H, hd, hd, S - T, scale};
    k3::cuda::attention_forward(q.cuda_f32(), k, v, att.cuda_f32() + b * T * D, nullptr, a, device::Storage::F32);
  }
  return att;
}

Tensor latent_attention(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                        Memory* const* memories) {
  profile::Scope scope("latent attention");
  const int64_t H = s.H, T = s.T, R = s.R, W = R + s.rope, qd = s.nope + s.rope, wrow = s.nope + s.v;
  const int64_t M = s.B * T;
  K3_CHECK(q.numel() == M * H * qd && rows.numel() == M * W && kv_b.numel() == H * wrow * R, "mla: q ", q.describe(),
           " rows ", rows.describe(), " kv_b ", kv_b.describe(), " do not fit B=", s.B, " T=", T, " H=", H);
  auto storage_of = [](const TokenRows* r) {
    return r->dtype() == DType::BF16 ? device::Storage::BF16 : device::Storage::F32;
  };
  const device::Storage storage = s.B ? storage_of(device_rows(memories[0], "mla")) : device::Storage::F32;
  std::vector<TokenRows*> caches(static_cast<size_t>(s.B));
  std::vector<void*> lats(static_cast<size_t>(s.B));
  std::vector<int64_t> p0s(static_cast<size_t>(s.B));
  int64_t longest = 0;
  for (int64_t b = 0; b < s.B; ++b) {  // all or none
    TokenRows* cache = caches[size_t(b)] = device_rows(memories[b], "mla");
    cache->reserve(T);
    K3_CHECK(storage_of(cache) == storage, "mla: a batch mixes fp32 and bf16 latent caches");
    p0s[size_t(b)] = cache->length();
    lats[size_t(b)] = cache->raw(0);
    // Captured for replays: a grid for the caches' capacity, which later steps stay within.
    longest = std::max(longest, device::capturing() ? cache->capacity() : cache->length() + T);
  }
  Tensor att = dev_empty({M, H * s.v});
  Tensor qt = dev_empty({M, H, W}), ob = dev_empty({M, H, R});
  const float* wkv = kv_b.cuda_f32();  // [H·(nope+v), R]
  // q̃ = [W_UKᵀ q_nope ; q_rope] per head (one batched call over the heads), for all rows at once.
  k3::cuda::gemm_strided(k3::cuda::Op::N, k3::cuda::Op::N, M, R, s.nope, 1.0f, q.cuda_f32(), H * qd, qd, wkv, R,
                         wrow * R, 0.0f, qt.cuda_f32(), H * W, W, H);
  k3::cuda::copy_blocks(q.cuda_f32() + s.nope, H * qd, qd, qt.cuda_f32() + R, H * W, W, M, H, s.rope);
  // A replayed step (device::Graph) finds the same caches, each longer by T.
  const device::Buffer d_lats = device::upload_new(lats.data(), lats.size() * sizeof(void*), device::Refresh::Constant);
  const device::Buffer d_p0s = device::upload_new(p0s.data(), p0s.size() * 8, device::Refresh::Advance);
  // The new rows into every sequence's cache, one launch; the lengths move only once the
  // attention over them is queued (a refused shape leaves every cache as it was).
  k3::cuda::append_rows(rows.cuda_f32(), W, s.B, T, W, d_lats.as<void* const>(), d_p0s.as<int64_t>(), storage);
  k3::cuda::latent_attention(qt.cuda_f32(), d_lats.as<const void* const>(), storage, d_p0s.as<int64_t>(), longest,
                             ob.cuda_f32(), s.B, T, H, W, R, s.scale);
  for (TokenRows* cache : caches) cache->advance(T);
  // o_h = W_UV ō, one batched call over the heads.
  k3::cuda::gemm_strided(k3::cuda::Op::N, k3::cuda::Op::T, M, s.v, R, 1.0f, ob.cuda_f32(), H * R, R, wkv + s.nope * R, R,
                         wrow * R, 0.0f, att.cuda_f32(), H * s.v, s.v, H);
  return att;
}

std::vector<Tensor> convs_with_tails(const std::vector<Tensor>& xs, const std::vector<Tensor>& ws, int64_t B, int64_t T,
                                     int64_t W, bool silu, Memory* const* memories) {
  const int S = int(xs.size());
  K3_CHECK(S >= 1 && S <= k3::cuda::kMaxStreams && ws.size() == xs.size(), "short_conv: ", S, " streams, ", ws.size(),
           " weights");
  k3::cuda::ConvStreams st;
  st.count = S;
  std::vector<Tensor> ys;
  for (int s = 0; s < S; ++s) {
    const int64_t C = xs[size_t(s)].dim(-1);
    K3_CHECK(xs[size_t(s)].numel() == B * T * C && ws[size_t(s)].numel() == C * W && W >= 1, "short_conv: stream ", s,
             " x ", xs[size_t(s)].describe(), " weight ", ws[size_t(s)].describe(), " for B=", B, " T=", T, " width ", W);
    ys.push_back(dev_empty(xs[size_t(s)].shape()));
    st.x[s] = xs[size_t(s)].cuda_f32();
    st.w[s] = ws[size_t(s)].cuda_f32();
    st.y[s] = ys.back().cuda_f32();
    st.start[s + 1] = st.start[s] + C;
  }
  std::vector<float*> tails(static_cast<size_t>(W > 1 ? B * S : 0));  // a width-1 convolution keeps no tail
  for (int64_t b = 0; W > 1 && b < B; ++b) {
    auto* state = device_memory<RecurrentState>(memories[b], "short_conv");
    K3_CHECK(state->conv_size() == W, "short_conv: a state kept for width ", state->conv_size(), " given width ", W);
    for (int s = 0; s < S; ++s) {
      K3_CHECK(state->tail_width(size_t(s)) == st.start[s + 1] - st.start[s], "short_conv: stream ", s, "'s tail holds ",
               state->tail_width(size_t(s)), " channels, not ", st.start[s + 1] - st.start[s]);
      tails[size_t(b * S + s)] = state->conv_tail(size_t(s));
    }
  }
  const device::Buffer d_tails = device::upload_new(tails.data(), tails.size() * sizeof(float*), device::Refresh::Constant);
  k3::cuda::convs_with_tails(st, d_tails.as<float*>(), B, T, W, silu);
  return ys;
}

Tensor delta_with_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                         const linear::DeltaOptions& opts, const linear::DeltaBatch& s, Memory* const* memories,
                         const linear::DecodeActivations* act) {
  if (opts.normalize == linear::Normalize::On)
    throw error("delta_rule", "the normalised linear attention has no CUDA decode yet");
  linear::cuda::check_supported(s.K, s.V);
  const int64_t rows = s.B * s.T;
  K3_CHECK(q.numel() == rows * s.H * s.K && k.numel() == q.numel() && v.numel() == rows * s.HV * s.V &&
               (opts.write != linear::Write::Delta || beta.numel() == rows * s.HV) &&
               (opts.decay != linear::Decay::Scalar || g.numel() == rows * s.HV) &&
               (opts.decay != linear::Decay::PerChannel || g.numel() == rows * s.HV * s.K),
           "delta_rule: inputs do not fit B=", s.B, " T=", s.T, " H=", s.H, " HV=", s.HV, " K=", s.K, " V=", s.V);
  const int64_t SS = s.HV * s.K * s.V;
  std::vector<float*> states(static_cast<size_t>(s.B));
  for (int64_t b = 0; b < s.B; ++b) {
    states[size_t(b)] = device_memory<RecurrentState>(memories[b], "delta_rule")->state();
    // The decode kernel reads each state as float4s (linear::cuda::DeviceArgs::states).
    K3_CHECK(reinterpret_cast<uintptr_t>(states[size_t(b)]) % 16 == 0, "delta_rule: sequence ", b,
             "'s state is not 16-byte aligned");
  }
  const device::Buffer d_states =
      device::upload_new(states.data(), states.size() * sizeof(float*), device::Refresh::Constant);
  Tensor o = dev_empty({s.B * s.T, s.HV * s.V});
  linear::cuda::DeviceArgs a = linear::cuda::fp32_args(opts, s.H, s.HV, s.K, s.V);
  a.N = s.B;
  a.max_len = s.T;
  a.q = q.cuda_f32();
  a.k = k.cuda_f32();
  a.v = v.cuda_f32();
  if (opts.write == linear::Write::Delta) a.beta = beta.cuda_f32();
  if (opts.decay != linear::Decay::None) a.g = g.cuda_f32();
  a.o = o.cuda_f32();
  if (act) {
    K3_CHECK(s.T == 1, "delta_rule: the fused activations are for the decode step (T = 1), got T = ", s.T);
    linear::cuda::DecodePrologue& pr = a.prologue;
    pr.l2norm = act->l2norm;
    pr.beta_logit = act->beta_logit && opts.write == linear::Write::Delta;
    if (act->gate != linear::cuda::GateInput::LogDecay && opts.decay != linear::Decay::None) {
      const int64_t per_head = opts.decay == linear::Decay::PerChannel ? s.K : 1;
      K3_CHECK(act->A_log.numel() >= s.HV && act->dt_bias.numel() == s.HV * per_head, "delta_rule: gate parameters A_log ",
               act->A_log.describe(), " and dt_bias ", act->dt_bias.describe(), " for ", s.HV, " heads of ", per_head,
               " channels");
      pr.gate = act->gate;
      pr.A_log = act->A_log.cuda_f32();
      pr.dt_bias = act->dt_bias.cuda_f32();
      pr.lower_bound = act->lower_bound;
    }
  }
  if (s.T == 1) {
    // The decode step: one kernel reads and writes every sequence's state where it lives.
    a.states = d_states.as<float* const>();
    linear::cuda::forward(a);
  } else {
    // Longer continuations: the states gathered into one [B, HV, K, V] array for the chunked
    // kernels, then scattered back.
    std::vector<int64_t> row0(static_cast<size_t>(s.B)), len(static_cast<size_t>(s.B), s.T);
    for (int64_t b = 0; b < s.B; ++b) row0[size_t(b)] = b * s.T;
    const device::Buffer d_row0 = device::upload_new(row0.data(), row0.size() * 8);
    const device::Buffer d_len = device::upload_new(len.data(), len.size() * 8);
    Tensor S = dev_empty({s.B, SS});
    k3::cuda::gather_blocks(d_states.as<const float*>(), s.B, SS, S.cuda_f32());
    a.row0 = d_row0.as<int64_t>();
    a.len = d_len.as<int64_t>();
    a.h0 = S.cuda_f32();
    a.ht = S.cuda_f32();  // in place
    linear::cuda::forward(a);
    k3::cuda::scatter_blocks(S.cuda_f32(), s.B, SS, d_states.as<float*>());
  }
  for (int64_t b = 0; b < s.B; ++b) device_memory<RecurrentState>(memories[b], "delta_rule")->advance(s.T);
  return o;
}

}  // namespace k3::gpu
