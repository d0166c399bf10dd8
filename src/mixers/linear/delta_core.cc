// Entry points of the delta-rule core: input validation, the Katharopoulos normaliser as a wrapper
// around the unnormalised core, the decode step and linear attention's feature map.
#include "mixers/linear/delta_core.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/parallel.h"
#include "mixers/linear/delta_internal.h"

namespace k3::linear {
namespace {

constexpr const char* kWho = "delta";

Tensor as_f32_contiguous(const Tensor& t) {
  if (!t.defined()) return t;
  if (t.dtype() == DType::F32 && t.is_contiguous()) return t;
  return t.to(DType::F32);
}

// Checked sizes and contiguous fp32 views of the inputs.
struct Resolved {
  detail::Problem p;
  Tensor q, k, v, beta, g, h0, z0;  // keep the views alive
};

Resolved resolve(const DeltaInputs& in, const DeltaOptions& opts) {
  Resolved r;
  if (!in.q.defined() || !in.k.defined() || !in.v.defined())
    throw error(kWho, "q, k and v are required");
  if (in.q.ndim() != 4) throw error(kWho, "q must be [B, T, H, K], got ", in.q.describe());
  r.q = as_f32_contiguous(in.q);  // [B, T, H, K]
  r.k = as_f32_contiguous(in.k);  // [B, T, H, K]
  r.v = as_f32_contiguous(in.v);  // [B, T, HV, V]
  detail::Problem& p = r.p;
  p.B = r.q.dim(0), p.T = r.q.dim(1), p.H = r.q.dim(2), p.K = r.q.dim(3);
  expect_shape(r.k, {p.B, p.T, p.H, p.K}, "delta: k (must match q [B, T, H, K])");
  if (r.v.ndim() != 4) throw error(kWho, "v must be [B, T, HV, V], got ", r.v.describe());
  expect_shape(r.v, {p.B, p.T, -1, -1}, "delta: v (must be [B, T, HV, V] with q's B and T)");
  p.HV = r.v.dim(2), p.V = r.v.dim(3);
  if (p.H <= 0 || p.K <= 0 || p.V <= 0 || p.HV <= 0 || p.HV % p.H != 0)
    throw error(kWho, "value heads HV = ", p.HV, " must be a positive multiple of the q/k heads H = ", p.H,
                " (and K, V > 0)");
  p.group = p.HV / p.H;
  p.write = opts.write;
  p.decay = opts.decay;
  p.scale = opts.scale > 0.0f ? opts.scale : 1.0f / std::sqrt(float(p.K));
  if (opts.chunk < 1 || opts.chunk > 256) throw error(kWho, "chunk size ", opts.chunk, " must be in [1, 256]");
  p.chunk = opts.chunk;
  if (opts.normalize == Normalize::On && opts.write != Write::Additive)
    throw error(kWho, "the normaliser is defined for linear attention (Write::Additive) only");

  if (opts.write == Write::Delta) {
    if (!in.beta.defined()) throw error(kWho, "the delta rule needs beta [B, T, HV]");
    r.beta = as_f32_contiguous(in.beta);
    expect_shape(r.beta, {p.B, p.T, p.HV}, "delta: beta");
    p.beta = r.beta.f32();
  }
  if (opts.decay != Decay::None) {
    if (!in.g.defined()) throw error(kWho, "a decaying rule needs the log-decay g");
    r.g = as_f32_contiguous(in.g);
    if (opts.decay == Decay::Scalar)
      expect_shape(r.g, {p.B, p.T, p.HV}, "delta: g (scalar decay)");
    else
      expect_shape(r.g, {p.B, p.T, p.HV, p.K}, "delta: g (per-channel decay)");
    p.g = r.g.f32();
  }

  if (!in.cu_seqlens.empty()) {
    const auto& cu = in.cu_seqlens;
    if (p.B != 1) throw error(kWho, "cu_seqlens needs B == 1 (packed sequences), got B = ", p.B);
    if (cu.size() < 2 || cu.front() != 0 || cu.back() != p.T)
      throw error(kWho, "cu_seqlens must start at 0 and end at T = ", p.T);
    for (size_t i = 1; i < cu.size(); ++i) {
      if (cu[i] < cu[i - 1]) throw error(kWho, "cu_seqlens must be non-decreasing");
      p.seqs.push_back({cu[i - 1], cu[i] - cu[i - 1]});
    }
  } else {
    for (int64_t b = 0; b < p.B; ++b) p.seqs.push_back({b * p.T, p.T});
  }
  p.N = int64_t(p.seqs.size());
  if (in.h0.defined()) {
    r.h0 = as_f32_contiguous(in.h0);
    expect_shape(r.h0, {p.N, p.HV, p.K, p.V}, "delta: h0 ([N, HV, K, V])");
    p.h0 = r.h0.f32();
  }
  if (in.z0.defined()) {
    if (opts.normalize != Normalize::On) throw error(kWho, "z0 is given but the normaliser is off");
    r.z0 = as_f32_contiguous(in.z0);
    expect_shape(r.z0, {p.N, p.HV, p.K}, "delta: z0 ([N, HV, K])");
  }
  p.q = r.q.f32();
  p.k = r.k.f32();
  p.v = r.v.f32();
  return r;
}

// The one place the core picks CPU or CUDA code (ARCHITECTURE.md, "dispatched from the op's .cc").
void run_forward(const detail::Problem& p, const detail::Outputs& out, Impl impl, const DeltaOptions& opts) {
  if (opts.device == Device::CUDA) {
    if constexpr (device::kCudaBuilt) {
      // With the normaliser, o is an intermediate (numerator and denominator): kept fp32.
      return detail::cuda_forward(p, out, opts.io_dtype,
                                  opts.normalize == Normalize::On ? DType::F32 : opts.io_dtype, impl);
    } else {
      device::require_cuda(kWho);
    }
  }
  if (impl == Impl::Recurrent)
    detail::reference_forward(p, out);
  else
    detail::chunked_forward(p, out);
}

void run_backward(const detail::Problem& p, const detail::Grads& gr, Impl impl, const DeltaOptions& opts) {
  if (opts.device == Device::CUDA) {
    if constexpr (device::kCudaBuilt) {
      return detail::cuda_backward(p, gr, opts.io_dtype,
                                   opts.normalize == Normalize::On ? DType::F32 : opts.io_dtype, impl);
    } else {
      device::require_cuda(kWho);
    }
  }
  if (impl == Impl::Recurrent)
    detail::reference_backward(p, gr);
  else
    detail::chunked_backward(p, gr);
}

// The normaliser as one more value column: with v' = [v, 1] and S' = [S, z] the unnormalised core
// yields num = S_tᵀ(s q_t) in columns [0, V) and s q_t·z_t in column V (README.md, "Normaliser").
struct Augmented {
  Tensor v;   // [B, T, HV, V + 1]
  Tensor h0;  // [N, HV, K, V + 1]
};

Augmented augment(const Resolved& r) {
  const detail::Problem& p = r.p;
  const int64_t V = p.V, V1 = p.V + 1;
  Augmented a;
  a.v = Tensor::empty({p.B, p.T, p.HV, V1});  // [B, T, HV, V + 1]
  const float* v = p.v;
  float* va = a.v.f32();
  for (int64_t i = 0; i < p.B * p.T * p.HV; ++i) {
    for (int64_t j = 0; j < V; ++j) va[i * V1 + j] = v[i * V + j];
    va[i * V1 + V] = 1.0f;
  }
  a.h0 = Tensor::zeros({p.N, p.HV, p.K, V1});  // [N, HV, K, V + 1]
  float* ha = a.h0.f32();
  const float* z0 = r.z0.defined() ? r.z0.f32() : nullptr;
  for (int64_t i = 0; i < p.N * p.HV * p.K; ++i) {
    if (p.h0)
      for (int64_t j = 0; j < V; ++j) ha[i * V1 + j] = p.h0[i * V + j];
    ha[i * V1 + V] = z0 ? z0[i] : 0.0f;
  }
  return a;
}

detail::Problem augmented_problem(const detail::Problem& p, const Augmented& a) {
  detail::Problem pa = p;
  pa.V = p.V + 1;
  pa.v = a.v.f32();
  pa.h0 = a.h0.f32();
  return pa;
}

// Splits [.., V + 1] rows into [.., V] and [..] (the last column).
void split_last_column(const Tensor& aug, int64_t rows, int64_t V, float* main, float* last) {
  const float* s = aug.f32();
  for (int64_t i = 0; i < rows; ++i) {
    if (main)
      for (int64_t j = 0; j < V; ++j) main[i * V + j] = s[i * (V + 1) + j];
    if (last) last[i] = s[i * (V + 1) + V];
  }
}

}  // namespace

DeltaOutputs delta_forward(const DeltaInputs& in, const DeltaOptions& opts, Impl impl) {
  Resolved r = resolve(in, opts);
  const detail::Problem& p = r.p;
  DeltaOutputs out;
  out.o = Tensor::empty({p.B, p.T, p.HV, p.V});   // [B, T, HV, V]
  out.ht = Tensor::empty({p.N, p.HV, p.K, p.V});  // [N, HV, K, V]
  if (opts.normalize == Normalize::Off) {
    run_forward(p, {out.o.f32(), out.ht.f32()}, impl, opts);
    return out;
  }
  Augmented a = augment(r);
  detail::Problem pa = augmented_problem(p, a);
  Tensor o_aug = Tensor::empty({p.B, p.T, p.HV, p.V + 1});   // [B, T, HV, V + 1]
  Tensor ht_aug = Tensor::empty({p.N, p.HV, p.K, p.V + 1});  // [N, HV, K, V + 1]
  run_forward(pa, {o_aug.f32(), ht_aug.f32()}, impl, opts);
  out.zt = Tensor::empty({p.N, p.HV, p.K});  // [N, HV, K]
  split_last_column(ht_aug, p.N * p.HV * p.K, p.V, out.ht.f32(), out.zt.f32());
  const float* oa = o_aug.f32();
  float* o = out.o.f32();
  for (int64_t i = 0; i < p.B * p.T * p.HV; ++i) {
    const float den = oa[i * (p.V + 1) + p.V] + opts.eps;
    for (int64_t j = 0; j < p.V; ++j) o[i * p.V + j] = oa[i * (p.V + 1) + j] / den;
  }
  return out;
}

DeltaGrads delta_backward(const DeltaInputs& in, const DeltaCotangents& cot, const DeltaOptions& opts, Impl impl) {
  Resolved r = resolve(in, opts);
  const detail::Problem& p = r.p;
  Tensor d_o = as_f32_contiguous(cot.d_o), dht = as_f32_contiguous(cot.dht), dzt = as_f32_contiguous(cot.dzt);
  if (d_o.defined()) expect_shape(d_o, {p.B, p.T, p.HV, p.V}, "delta: d_o");
  if (dht.defined()) expect_shape(dht, {p.N, p.HV, p.K, p.V}, "delta: dht");
  if (dzt.defined()) expect_shape(dzt, {p.N, p.HV, p.K}, "delta: dzt");

  DeltaGrads gd;
  gd.dq = Tensor::zeros({p.B, p.T, p.H, p.K});    // [B, T, H, K]
  gd.dk = Tensor::zeros({p.B, p.T, p.H, p.K});    // [B, T, H, K]
  gd.dv = Tensor::zeros({p.B, p.T, p.HV, p.V});   // [B, T, HV, V]
  gd.dh0 = Tensor::zeros({p.N, p.HV, p.K, p.V});  // [N, HV, K, V]
  if (opts.write == Write::Delta) gd.dbeta = Tensor::zeros({p.B, p.T, p.HV});  // [B, T, HV]
  if (opts.decay != Decay::None) gd.dg = Tensor::zeros(r.g.shape());  // [B, T, HV(, K)]
  detail::Grads gr;
  gr.dq = gd.dq.f32();
  gr.dk = gd.dk.f32();
  gr.dbeta = gd.dbeta.defined() ? gd.dbeta.f32() : nullptr;
  gr.dg = gd.dg.defined() ? gd.dg.f32() : nullptr;

  if (opts.normalize == Normalize::Off) {
    gr.d_o = d_o.defined() ? d_o.f32() : nullptr;
    gr.dht = dht.defined() ? dht.f32() : nullptr;
    gr.dv = gd.dv.f32();
    gr.dh0 = gd.dh0.f32();
    run_backward(p, gr, impl, opts);
    return gd;
  }

  // Normalised: o = num / den with den = o_aug[V] + eps, so dnum = d_o / den and
  // dden = −Σ_j d_o_j num_j / den².
  Augmented a = augment(r);
  detail::Problem pa = augmented_problem(p, a);
  const int64_t V = p.V, V1 = p.V + 1, rows = p.B * p.T * p.HV, srows = p.N * p.HV * p.K;
  Tensor o_aug = Tensor::empty({p.B, p.T, p.HV, V1});   // [B, T, HV, V + 1]
  Tensor ht_aug = Tensor::empty({p.N, p.HV, p.K, V1});  // [N, HV, K, V + 1]
  run_forward(pa, {o_aug.f32(), ht_aug.f32()}, impl, opts);
  Tensor do_aug = Tensor::zeros({p.B, p.T, p.HV, V1});   // [B, T, HV, V + 1]
  Tensor dht_aug = Tensor::zeros({p.N, p.HV, p.K, V1});  // [N, HV, K, V + 1]
  if (d_o.defined()) {
    const float* oa = o_aug.f32();
    const float* dy = d_o.f32();
    float* da = do_aug.f32();
    for (int64_t i = 0; i < rows; ++i) {
      const double den = double(oa[i * V1 + V]) + opts.eps;
      double dden = 0.0;
      for (int64_t j = 0; j < V; ++j) {
        da[i * V1 + j] = float(dy[i * V + j] / den);
        dden -= double(dy[i * V + j]) * oa[i * V1 + j] / (den * den);
      }
      da[i * V1 + V] = float(dden);
    }
  }
  float* dha = dht_aug.f32();
  for (int64_t i = 0; i < srows; ++i) {
    if (dht.defined())
      for (int64_t j = 0; j < V; ++j) dha[i * V1 + j] = dht.f32()[i * V + j];
    if (dzt.defined()) dha[i * V1 + V] = dzt.f32()[i];
  }
  Tensor dv_aug = Tensor::zeros({p.B, p.T, p.HV, V1});   // [B, T, HV, V + 1]
  Tensor dh0_aug = Tensor::zeros({p.N, p.HV, p.K, V1});  // [N, HV, K, V + 1]
  gr.d_o = do_aug.f32();
  gr.dht = dht_aug.f32();
  gr.dv = dv_aug.f32();
  gr.dh0 = dh0_aug.f32();
  run_backward(pa, gr, impl, opts);
  split_last_column(dv_aug, rows, V, gd.dv.f32(), nullptr);
  gd.dz0 = Tensor::zeros({p.N, p.HV, p.K});  // [N, HV, K]
  split_last_column(dh0_aug, srows, V, gd.dh0.f32(), gd.dz0.f32());
  return gd;
}

Tensor delta_step(const DeltaInputs& in, DeltaState& state, const DeltaOptions& opts) {
  if (!in.cu_seqlens.empty()) throw error(kWho, "delta_step takes one token per sequence, not cu_seqlens");
  DeltaInputs one = in;
  one.h0 = Tensor();
  one.z0 = Tensor();
  Resolved r = resolve(one, opts);
  const detail::Problem& p = r.p;
  if (p.T != 1) throw error(kWho, "delta_step takes one token per sequence (T = 1), got T = ", p.T);
  const bool norm = opts.normalize == Normalize::On;
  const bool per_seq = !state.S.defined();
  if (per_seq) {
    if (int64_t(state.S_seq.size()) != p.N || (norm && int64_t(state.z_seq.size()) != p.N))
      throw error(kWho, "delta_step: ", state.S_seq.size(), " per-sequence states for N = ", p.N, " sequences");
  } else {
    expect_shape(state.S, {p.N, p.HV, p.K, p.V}, "delta_step: state S ([N, HV, K, V])");
    K3_CHECK(state.S.dtype() == DType::F32 && state.S.is_contiguous());
    if (norm) {
      expect_shape(state.z, {p.N, p.HV, p.K}, "delta_step: normaliser state z ([N, HV, K])");
      K3_CHECK(state.z.dtype() == DType::F32 && state.z.is_contiguous());
    }
  }
  Tensor o = Tensor::empty({p.N, 1, p.HV, p.V});  // [N, 1, HV, V]
  float* S_all = per_seq ? nullptr : state.S.f32();
  float* z_all = norm && !per_seq ? state.z.f32() : nullptr;
  float* o_all = o.f32();
  const int64_t K = p.K, V = p.V;
  parallel_for(p.N * p.HV, std::max<int64_t>(1, (int64_t(1) << 16) / (p.K * p.V)), [&](int64_t begin, int64_t end) {
    std::vector<float> a(K), delta(V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.HV, hv = task % p.HV, h = hv / p.group, r0 = n;  // row n·T + 0
      float* S = per_seq ? state.S_seq[size_t(n)] + hv * K * V : S_all + p.state_off(n, hv);  // [K, V]
      const float* q = p.q_row(r0, h);
      const float* k = p.k_row(r0, h);
      const float* v = p.v_row(r0, hv);
      for (int64_t d = 0; d < K; ++d) a[d] = std::exp(p.g_at(r0, hv, d));
      // Spec §0: decay the old state, then write (δ = β(v − Sᵀk) or v), then read.
      for (int64_t d = 0; d < K; ++d)
        for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a[d];
      if (p.write == Write::Delta) {
        for (int64_t j = 0; j < V; ++j) delta[j] = 0.0f;
        for (int64_t d = 0; d < K; ++d)
          for (int64_t j = 0; j < V; ++j) delta[j] += S[d * V + j] * k[d];
        const float beta = p.beta_at(r0, hv);
        for (int64_t j = 0; j < V; ++j) delta[j] = beta * (v[j] - delta[j]);
      } else {
        for (int64_t j = 0; j < V; ++j) delta[j] = v[j];
      }
      for (int64_t d = 0; d < K; ++d)
        for (int64_t j = 0; j < V; ++j) S[d * V + j] += k[d] * delta[j];
      float* out = o_all + (n * p.HV + hv) * V;
      for (int64_t j = 0; j < V; ++j) out[j] = 0.0f;
      for (int64_t d = 0; d < K; ++d) {
        const float qs = p.scale * q[d];
        for (int64_t j = 0; j < V; ++j) out[j] += S[d * V + j] * qs;
      }
      if (norm) {
        float* z = per_seq ? state.z_seq[size_t(n)] + hv * K : z_all + (n * p.HV + hv) * K;
        double den = 0.0;
        for (int64_t d = 0; d < K; ++d) {
          z[d] = a[d] * z[d] + k[d];
          den += double(p.scale) * q[d] * z[d];
        }
        const float inv = float(1.0 / (den + opts.eps));
        for (int64_t j = 0; j < V; ++j) out[j] *= inv;
      }
    }
  });
  return o;
}

}  // namespace k3::linear
