#include "mixers/linear/delta_layer.h"

#include <cstring>
#include <optional>

#include "core/profile.h"
#include "ops/ag_conv.h"
#include "ops/ag_heads.h"
#include "mixers/linear/delta_states.h"

namespace k3 {

DeltaLayerOptions DeltaLayerOptions::kimi_linear_kda(int64_t d_model, int64_t heads, int64_t head_dim, float eps) {
  DeltaLayerOptions o;
  o.kind = DeltaKind::Kda;
  o.naming = DeltaNaming::KimiHF;
  o.d_model = d_model;
  o.heads = heads;
  o.head_k_dim = o.head_v_dim = head_dim;
  o.gate_form = KdaGateForm::Softplus;
  o.a_log_shape = {1, 1, heads, 1};
  o.output_gate = DeltaOutputGate::KimiLowRank;
  o.norm_eps = eps;
  return o;
}

DeltaLayerOptions DeltaLayerOptions::kimi_k3_kda(int64_t d_model, int64_t heads, int64_t head_dim, float eps) {
  DeltaLayerOptions o = kimi_linear_kda(d_model, heads, head_dim, eps);
  o.gate_form = KdaGateForm::LowerBound;
  o.gate_lower_bound = -5.0f;
  o.a_log_shape = {heads};  // the kimi-k3-tiny fixture stores [H*K] with the H used values first: set it there
  o.output_gate = DeltaOutputGate::FullRank;
  return o;
}

DeltaLayerOptions DeltaLayerOptions::fla_linear_attention(int64_t d_model, int64_t heads, int64_t head_k_dim,
                                                          int64_t head_v_dim) {
  DeltaLayerOptions o;
  o.kind = DeltaKind::LinearAttention;
  o.naming = DeltaNaming::Fla;
  o.d_model = d_model;
  o.heads = heads;
  o.head_k_dim = head_k_dim;
  o.head_v_dim = head_v_dim;
  o.conv_size = 0;
  o.silu = false;
  o.qk_l2norm = false;
  o.feature_map = FeatureMap::Elu1;
  o.use_beta = false;
  o.output_gate = DeltaOutputGate::None;
  o.normalize = false;
  return o;
}

DeltaLayerOptions DeltaLayerOptions::fla_delta_net(int64_t d_model, int64_t heads, int64_t head_dim, bool use_gate) {
  DeltaLayerOptions o;
  o.kind = DeltaKind::DeltaNet;
  o.naming = DeltaNaming::Fla;
  o.d_model = d_model;
  o.heads = heads;
  o.head_k_dim = o.head_v_dim = head_dim;
  o.output_gate = use_gate ? DeltaOutputGate::Swish : DeltaOutputGate::None;
  return o;
}

DeltaLayerOptions DeltaLayerOptions::fla_gated_delta_net(int64_t d_model, int64_t heads, int64_t value_heads,
                                                         int64_t head_k_dim, int64_t head_v_dim) {
  DeltaLayerOptions o;
  o.kind = DeltaKind::GatedDeltaNet;
  o.naming = DeltaNaming::Fla;
  o.d_model = d_model;
  o.heads = heads;
  o.value_heads = value_heads;
  o.head_k_dim = head_k_dim;
  o.head_v_dim = head_v_dim;
  o.output_gate = DeltaOutputGate::Swish;
  return o;
}

DeltaLayerOptions DeltaLayerOptions::qwen3_next_gdn(int64_t d_model, int64_t heads, int64_t value_heads,
                                                    int64_t head_k_dim, int64_t head_v_dim, int64_t conv_size,
                                                    float eps) {
  DeltaLayerOptions o = fla_gated_delta_net(d_model, heads, value_heads, head_k_dim, head_v_dim);
  o.naming = DeltaNaming::Qwen3Next;
  o.conv_size = conv_size;
  o.norm_eps = eps;
  return o;
}

DeltaLayer::DeltaLayer(const DeltaLayerOptions& o)
    : o_(o), H_(o.heads), HV_(o.hv()), K_(o.head_k_dim), V_(o.head_v_dim) {
  const int64_t D = o.d_model;
  K3_CHECK(D > 0 && H_ > 0 && K_ > 0 && V_ > 0 && HV_ % H_ == 0, "delta layer: bad sizes d_model=", D, " heads=", H_,
           " value_heads=", HV_, " K=", K_, " V=", V_);
  K3_CHECK(!o.normalize || o.kind == DeltaKind::LinearAttention, "delta layer: the normaliser is for linear attention");
  K3_CHECK(o.conv_size >= 0, "delta layer: conv_size ", o.conv_size);
  const bool qwen = o.naming == DeltaNaming::Qwen3Next;
  if (qwen) {
    K3_CHECK(o.kind == DeltaKind::GatedDeltaNet && o.use_beta && o.output_gate == DeltaOutputGate::Swish &&
                 o.output_norm && o.conv_size > 0,
             "delta layer: Qwen3-Next's fused projections belong to its Gated DeltaNet (β, swish-gated norm, conv)");
    in_proj_qkvz_ = Linear(D, 2 * H_ * K_ + 2 * HV_ * V_, Bias::None);
    in_proj_ba_ = Linear(D, 2 * HV_, Bias::None);
    qkv_conv_ = parameter({2 * H_ * K_ + HV_ * V_, 1, o.conv_size});
  } else {
    q_proj_ = Linear(D, H_ * K_, Bias::None);
    k_proj_ = Linear(D, H_ * K_, Bias::None);
    v_proj_ = Linear(D, HV_ * V_, Bias::None);
    if (o.conv_size > 0) {
      q_conv_ = parameter({H_ * K_, 1, o.conv_size});
      k_conv_ = parameter({H_ * K_, 1, o.conv_size});
      v_conv_ = parameter({HV_ * V_, 1, o.conv_size});
    }
  }
  const bool delta = o.kind != DeltaKind::LinearAttention;
  if (delta && o.use_beta && !qwen) b_proj_ = Linear(D, HV_, Bias::None);
  if (o.kind == DeltaKind::GatedDeltaNet) {
    if (!qwen) a_proj_ = Linear(D, HV_, Bias::None);
    A_log_ = parameter(o.a_log_shape.empty() ? Shape{HV_} : o.a_log_shape);
    dt_bias_ = parameter({HV_});
  } else if (o.kind == DeltaKind::Kda) {
    const int64_t r = o.gate_rank ? o.gate_rank : V_;
    f_a_proj_ = Linear(D, r, Bias::None);
    f_b_proj_ = Linear(r, HV_ * K_, Bias::None);
    A_log_ = parameter(o.a_log_shape.empty() ? Shape{HV_} : o.a_log_shape);
    dt_bias_ = parameter({HV_ * K_});
  }
  if (A_log_) K3_CHECK(A_log_->value.numel() >= HV_, "delta layer: A_log shape ", shape_str(A_log_->value.shape()),
                       " holds fewer than ", HV_, " values");
  switch (o.output_gate) {
    case DeltaOutputGate::None: break;
    case DeltaOutputGate::KimiLowRank: {
      const int64_t r = o.output_gate_rank ? o.output_gate_rank : V_;
      g_a_proj_ = Linear(D, r, Bias::None);
      g_b_proj_ = Linear(r, HV_ * V_, o.naming == DeltaNaming::Fla ? Bias::Present : Bias::None);
      break;
    }
    case DeltaOutputGate::FullRank:
    case DeltaOutputGate::Swish:
      if (!qwen) g_proj_ = Linear(D, HV_ * V_, Bias::None);
      break;
  }
  if (o.output_norm) o_norm_ = parameter({V_});
  o_proj_ = Linear(HV_ * V_, D, Bias::None);
}

std::string_view DeltaLayer::name() const {
  switch (o_.kind) {
    case DeltaKind::LinearAttention: return "linear_attention";
    case DeltaKind::DeltaNet: return "deltanet";
    case DeltaKind::GatedDeltaNet: return "gated_deltanet";
    case DeltaKind::Kda: return "kda";
  }
  return "delta";
}

linear::DeltaOptions DeltaLayer::core_options() const {
  linear::DeltaOptions c;
  c.write = o_.kind == DeltaKind::LinearAttention ? linear::Write::Additive : linear::Write::Delta;
  c.decay = o_.kind == DeltaKind::GatedDeltaNet ? linear::Decay::Scalar
            : o_.kind == DeltaKind::Kda         ? linear::Decay::PerChannel
                                                : linear::Decay::None;
  c.scale = o_.scale;
  c.chunk = o_.chunk;
  c.normalize = o_.normalize ? linear::Normalize::On : linear::Normalize::Off;
  c.eps = o_.normalize_eps;
  return c;
}

// Short conv of one stream from zero padding (no memories, differentiable).
Var DeltaLayer::conv(const Var& x, const Var& w, const SeqBatch& batch) const {
  if (!w) return x;
  K3_CHECK(!batch.memories, "delta layer: the conv streams continue their tails through linear::convs_with_tails");
  return ag::short_conv(x, w, batch.B, batch.T);
}

DeltaLayer::ConvWeights DeltaLayer::conv_weights() const {
  if (!qkv_conv_) return {q_conv_, k_conv_, v_conv_};
  // Rows [a, b) of the fused [C, 1, W] weight, differentiable (a view of its flat values).
  const int64_t W = o_.conv_size, C = qkv_conv_->value.dim(0);
  auto rows = [&](int64_t a, int64_t b) {
    return ag::reshape(ag::slice_last(ag::reshape(qkv_conv_, {1, C * W}), a * W, b * W), {b - a, 1, W});
  };
  const int64_t hk = H_ * K_;
  return {rows(0, hk), rows(hk, 2 * hk), rows(2 * hk, C)};
}

Var DeltaLayer::core(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                     const SeqBatch& batch) const {
  const linear::DeltaOptions c = core_options();
  const int64_t B = batch.B, T = batch.T;
  if (!batch.memories) return ag::delta_rule(q, k, v, beta, g, c, ag::DeltaShape{B, T, H_, HV_, K_, V_});
  // Continue each sequence from its recurrent state (inference: no graph through the state).
  return constant(linear::delta_with_states(q->value, k->value, v->value, beta ? beta->value : Tensor(),
                                            g ? g->value : Tensor(), c, linear::DeltaBatch{B, T, H_, HV_, K_, V_},
                                            batch.memories));
}

Var DeltaLayer::forward(const Var& x, const SeqBatch& batch) const {
  K3_CHECK(x->value.ndim() == 2 && x->value.dim(0) == batch.B * batch.T && x->value.dim(1) == o_.d_model,
           "delta layer: x ", x->value.describe(), " for B=", batch.B, " T=", batch.T, " d_model=", o_.d_model);
  std::optional<profile::Scope> scope(std::in_place, "projections");
  // Decoding (memories): every projection of x at once, one grouped GEMM on the device
  // (apply_each); otherwise each where it is used.
  enum Proj { kQ, kK, kV, kBeta, kDecay, kGate, kProjs };
  std::vector<Var> px(kProjs);
  if (o_.naming == DeltaNaming::Qwen3Next) {
    // Two fused GEMMs, sliced per key head: q, k, the head's value heads' v and z; b then a.
    const std::vector<Var> f = apply_each({&in_proj_qkvz_, &in_proj_ba_}, x);
    const int64_t r = HV_ / H_;
    px[kQ] = ag::head_slice(f[0], H_, 0, K_);
    px[kK] = ag::head_slice(f[0], H_, K_, 2 * K_);
    px[kV] = ag::head_slice(f[0], H_, 2 * K_, 2 * K_ + r * V_);
    px[kGate] = ag::head_slice(f[0], H_, 2 * K_ + r * V_, 2 * K_ + 2 * r * V_);
    px[kBeta] = ag::head_slice(f[1], H_, 0, r);
    px[kDecay] = ag::head_slice(f[1], H_, r, 2 * r);
  } else if (batch.memories) {
    std::vector<const Linear*> ls = {&q_proj_, &k_proj_, &v_proj_};
    std::vector<Proj> which = {kQ, kK, kV};
    auto want = [&](const Linear& l, Proj p) {
      if (l.weight) ls.push_back(&l), which.push_back(p);
    };
    if (o_.kind != DeltaKind::LinearAttention && o_.use_beta) want(b_proj_, kBeta);
    if (o_.kind == DeltaKind::GatedDeltaNet) want(a_proj_, kDecay);
    if (o_.kind == DeltaKind::Kda) want(f_a_proj_, kDecay);
    if (o_.output_gate == DeltaOutputGate::KimiLowRank) want(g_a_proj_, kGate);
    if (o_.output_gate == DeltaOutputGate::FullRank || o_.output_gate == DeltaOutputGate::Swish) want(g_proj_, kGate);
    std::vector<Var> ys = apply_each(ls, x);
    for (size_t i = 0; i < ys.size(); ++i) px[which[i]] = std::move(ys[i]);
  }
  auto proj = [&](Proj p, const Linear& l) { return px[p] ? px[p] : l(x); };
  scope.emplace("q k v");
  Var q, k, v;
  bool silu_done = false;
  const ConvWeights cw = conv_weights();
  if (batch.memories && cw.q) {
    // Decoding: the three streams' convolutions (and their SiLU) continuing each sequence's tails,
    // one launch on CUDA. The state step must take the heads before the tails move on, or a
    // refused shape would leave the tails a token ahead of the state.
    linear::check_state_step(x->value.device(), K_, V_);
    const std::vector<Tensor> ys =
        linear::convs_with_tails({proj(kQ, q_proj_)->value, proj(kK, k_proj_)->value, proj(kV, v_proj_)->value},
                                 {cw.q->value, cw.k->value, cw.v->value}, batch.B, batch.T, o_.conv_size,
                                 o_.silu, batch.memories);
    q = constant(ys[0]), k = constant(ys[1]), v = constant(ys[2]);
    silu_done = o_.silu;
  } else {
    q = conv(proj(kQ, q_proj_), cw.q, batch);
    k = conv(proj(kK, k_proj_), cw.k, batch);
    v = conv(proj(kV, v_proj_), cw.v, batch);
  }
  // The decay gate's pre-activations (GDN: a_proj; KDA: the low-rank f_a, f_b).
  auto gate_input = [&] { return o_.kind == DeltaKind::Kda ? f_b_proj_(proj(kDecay, f_a_proj_)) : proj(kDecay, a_proj_); };
  Var o;
  // The decode step: q/k normalisation, β's sigmoid and the decay gate handed to the state step
  // (on CUDA inside its kernel, one launch where there were five).
  if (batch.memories && batch.T == 1 && (silu_done || !o_.silu) && o_.feature_map != FeatureMap::Elu1 &&
      !o_.normalize && (o_.kind == DeltaKind::LinearAttention || o_.use_beta)) {
    scope.emplace("gates");
    linear::DecodeActivations act;
    act.l2norm = o_.qk_l2norm;
    Var beta, g;
    if (o_.kind != DeltaKind::LinearAttention) {
      beta = proj(kBeta, b_proj_);
      act.beta_logit = true;
    }
    if (o_.kind == DeltaKind::GatedDeltaNet || o_.kind == DeltaKind::Kda) {
      g = gate_input();
      const bool lb = o_.kind == DeltaKind::Kda && o_.gate_form == KdaGateForm::LowerBound;
      act.gate = lb ? linear::cuda::GateInput::LowerBound : linear::cuda::GateInput::Softplus;
      act.lower_bound = o_.gate_lower_bound;
      act.A_log = A_log_->value;
      act.dt_bias = dt_bias_->value;
    }
    scope.reset();
    o = constant(linear::delta_with_states(q->value, k->value, v->value, beta ? beta->value : Tensor(),
                                           g ? g->value : Tensor(), core_options(),
                                           linear::DeltaBatch{batch.B, batch.T, H_, HV_, K_, V_}, batch.memories, &act));
  }
  if (!o) {
    if (o_.silu && !silu_done) {
      q = ag::silu(q);
      k = ag::silu(k);
      v = ag::silu(v);
    }
    if (o_.feature_map == FeatureMap::Elu1) {
      q = ag::elu1(q);
      k = ag::elu1(k);
    }
    if (o_.qk_l2norm) {
      q = ag::l2norm(q, K_);
      k = ag::l2norm(k, K_);
    }
    scope.emplace("gates");
    Var beta, g;
    if (o_.kind != DeltaKind::LinearAttention) {
      if (o_.use_beta) {
        beta = ag::sigmoid(proj(kBeta, b_proj_));
      } else {
        beta = constant(Tensor::full({x->value.dim(0), HV_}, 1.0f));
      }
    }
    if (o_.kind == DeltaKind::GatedDeltaNet)
      g = ag::kda_gate(gate_input(), A_log_, dt_bias_, HV_, 1, KdaGateForm::Softplus);
    else if (o_.kind == DeltaKind::Kda)
      g = ag::kda_gate(gate_input(), A_log_, dt_bias_, HV_, K_, o_.gate_form, o_.gate_lower_bound);

    scope.reset();
    o = core(q, k, v, beta, g, batch);  // [B*T, HV*V]
  }
  scope.emplace("output");

  Var gate;
  ag::NormGate act = ag::NormGate::None;
  switch (o_.output_gate) {
    case DeltaOutputGate::None: break;
    case DeltaOutputGate::KimiLowRank: gate = g_b_proj_(proj(kGate, g_a_proj_)); act = ag::NormGate::Sigmoid; break;
    case DeltaOutputGate::FullRank: gate = proj(kGate, g_proj_); act = ag::NormGate::Sigmoid; break;
    case DeltaOutputGate::Swish: gate = proj(kGate, g_proj_); act = ag::NormGate::Swish; break;
  }
  if (o_.output_norm) {
    o = ag::gated_rmsnorm(o, gate, o_norm_, V_, o_.norm_eps, act);
  } else if (gate) {
    o = ag::mul(o, act == ag::NormGate::Sigmoid ? ag::sigmoid(gate) : ag::silu(gate));
  }
  return o_proj_(o);
}

std::unique_ptr<Memory> DeltaLayer::new_memory(int64_t) const {
  std::vector<int64_t> channels;
  if (o_.conv_size > 1) channels = {H_ * K_, H_ * K_, HV_ * V_};
  return std::make_unique<RecurrentState>(HV_, K_, V_, o_.normalize, std::move(channels), o_.conv_size,
                                          o_proj_.weight->value.device());
}

std::vector<MemorySpec> DeltaLayer::memory_spec() const {
  const double state = double(HV_ * K_ * V_ + (o_.normalize ? HV_ * K_ : 0)) * sizeof(float);
  std::vector<MemorySpec> s = {{MemoryKind::RecurrentState, 0, state}};
  if (o_.conv_size > 1)
    s.push_back({MemoryKind::ConvTail, 0, double((o_.conv_size - 1) * (2 * H_ * K_ + HV_ * V_)) * sizeof(float)});
  return s;
}

void DeltaLayer::visit(const std::string& prefix, const ParamVisitor& v) const {
  const bool fla = o_.naming == DeltaNaming::Fla;
  auto p = [&](const char* n) { return join_name(prefix, n); };
  if (o_.naming == DeltaNaming::Qwen3Next) {
    in_proj_qkvz_.visit(p("in_proj_qkvz"), v);
    in_proj_ba_.visit(p("in_proj_ba"), v);
    v(p("conv1d.weight"), *qkv_conv_, ParamKind::Weight);
    v(p("A_log"), *A_log_, ParamKind::Other);
    v(p("dt_bias"), *dt_bias_, ParamKind::Other);
    v(p("norm.weight"), *o_norm_, ParamKind::Norm);
    o_proj_.visit(p("out_proj"), v);
    return;
  }
  q_proj_.visit(p("q_proj"), v);
  k_proj_.visit(p("k_proj"), v);
  v_proj_.visit(p("v_proj"), v);
  if (q_conv_) {
    v(p("q_conv1d.weight"), *q_conv_, ParamKind::Weight);
    v(p("k_conv1d.weight"), *k_conv_, ParamKind::Weight);
    v(p("v_conv1d.weight"), *v_conv_, ParamKind::Weight);
  }
  if (o_.kind == DeltaKind::Kda) {
    f_a_proj_.visit(p(fla ? "f_proj.0" : "f_a_proj"), v);
    f_b_proj_.visit(p(fla ? "f_proj.1" : "f_b_proj"), v);
  }
  if (b_proj_.weight) b_proj_.visit(p("b_proj"), v);
  if (o_.kind == DeltaKind::GatedDeltaNet) a_proj_.visit(p("a_proj"), v);
  if (A_log_) {
    v(p("A_log"), *A_log_, ParamKind::Other);
    v(p("dt_bias"), *dt_bias_, ParamKind::Other);
  }
  switch (o_.output_gate) {
    case DeltaOutputGate::None: break;
    case DeltaOutputGate::KimiLowRank:
      g_a_proj_.visit(p(fla ? "g_proj.0" : "g_a_proj"), v);
      g_b_proj_.visit(p(fla ? "g_proj.1" : "g_b_proj"), v);
      break;
    case DeltaOutputGate::FullRank:
    case DeltaOutputGate::Swish: g_proj_.visit(p("g_proj"), v); break;
  }
  if (o_norm_) v(p(fla && o_.kind == DeltaKind::LinearAttention ? "norm.weight" : "o_norm.weight"), *o_norm_, ParamKind::Norm);
  o_proj_.visit(p("o_proj"), v);
}

}  // namespace k3
