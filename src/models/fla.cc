#include "models/fla.h"

#include <cmath>

#include "core/random.h"
#include "ffn/glu.h"
#include "models/init.h"
#include "ops/ag.h"

namespace k3 {

DeltaLayerOptions fla_layer_options(const FlaConfig& c) {
  const int64_t D = c.hidden_size, H = c.num_heads;
  const int64_t dk = c.head_dim.value_or(int64_t(double(D) * c.expand_k) / H);
  const int64_t dv = c.head_dim ? int64_t(double(*c.head_dim) * c.expand_v) : int64_t(double(D) * c.expand_v) / H;
  DeltaLayerOptions o;
  if (c.model_type == "linear_attn") {
    o = DeltaLayerOptions::fla_linear_attention(D, H, dk, dv);
  } else if (c.model_type == "delta_net") {
    o = DeltaLayerOptions::fla_delta_net(D, H, dk, c.use_gate.value_or(false));
    o.head_v_dim = dv;
  } else if (c.model_type == "gated_deltanet") {
    o = DeltaLayerOptions::fla_gated_delta_net(D, H, c.num_v_heads.value_or(H), dk, dv);
    if (!c.use_gate.value_or(true)) o.output_gate = DeltaOutputGate::None;
  } else {  // kda
    o = DeltaLayerOptions::kimi_linear_kda(D, H, dk, float(c.norm_eps));
    o.naming = DeltaNaming::Fla;
    o.value_heads = c.num_v_heads.value_or(H);
    o.head_v_dim = dv;
    o.a_log_shape = {o.value_heads};
    if (c.lower_bound) {
      o.gate_form = ag::KdaGateForm::LowerBound;
      o.gate_lower_bound = float(*c.lower_bound);
    }
    // fla's KDA always gates its output norm; use_gate: false (a k3 extension for KDA) drops the
    // gate and keeps the RMSNorm, so a study can compare memories without the gate.
    if (!c.use_gate.value_or(true)) o.output_gate = DeltaOutputGate::None;
  }
  if (c.model_type != "linear_attn") o.conv_size = c.use_short_conv ? c.conv_size : 0;
  o.norm_eps = float(c.norm_eps);
  return o;
}

FlaModel::FlaModel(const FlaConfig& c, const Json& raw) : c_(c), raw_(raw) {
  const int64_t D = c.hidden_size;
  const float eps = float(c.norm_eps);
  // fla's GatedMLP width: hidden_ratio · D · 2/3, rounded up to a multiple of 256.
  const int64_t inter = c.intermediate_size.value_or(256 * ((int64_t(double(D) * c.hidden_ratio * 2 / 3) + 255) / 256));
  embed_ = parameter({c.vocab_size, D});
  lm_head_ = c.tie_word_embeddings ? embed_ : parameter({c.vocab_size, D});
  const DeltaLayerOptions lo = fla_layer_options(c);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    blocks_.add(PreNormBlock(Norm(NormType::RMSNorm, D, eps), std::make_unique<DeltaLayer>(lo), Norm(NormType::RMSNorm, D, eps),
                             std::make_unique<GluMlp>(D, inter, GluOptions{}), BlockNames{"attn_norm", "attn", "mlp_norm", "mlp"}));
  norm_ = Norm(NormType::RMSNorm, D, eps);
  eos_token_id = c.eos_token_id;
}

std::unique_ptr<Model> FlaModel::from_config(const Json& j, const std::string& where) {
  FlaConfig c = read_config<FlaConfig>(j, where);
  const int64_t dk = c.head_dim.value_or(int64_t(double(c.hidden_size) * c.expand_k) / c.num_heads);
  if (dk <= 0) throw error("config", where, ": head dimension works out to ", dk);
  if (c.num_v_heads && *c.num_v_heads % c.num_heads != 0)
    throw error("config", where, ": num_v_heads ", *c.num_v_heads, " must be a multiple of num_heads ", c.num_heads);
  if (j.value("allow_neg_eigval", false)) throw error("config", where, ": allow_neg_eigval is not supported yet");
  return std::make_unique<FlaModel>(c, j);
}

std::unique_ptr<Model> FlaModel::load(const std::string& dir, const Json& j, const LoadPlan& plan) {
  auto m = from_config(j, dir + "/config.json");
  load_params(*m, Checkpoint::open(dir), LoadOptions{.alias = {}, .ignorable = {}, .plan = plan});
  return m;
}

void FlaModel::visit(const ParamVisitor& v) const {
  v("model.embeddings.weight", *embed_, ParamKind::Embedding);
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l].visit("model.layers." + std::to_string(l), v);
  norm_.visit("model.norm", v);
  if (!c_.tie_word_embeddings) v("lm_head.weight", *lm_head_, ParamKind::Weight);
}

std::vector<LayerMemory> FlaModel::memory_layers() const { return blocks_.memory_layers(); }

Context FlaModel::new_context(int64_t max_tokens) const { return blocks_.new_context(max_tokens); }

Var FlaModel::hidden(const TokenBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  Var x = ag::embedding(embed_, std::vector<int64_t>(batch.ids, batch.ids + B * T));
  x = blocks_.forward(x, B, T, batch.contexts);
  return norm_(x);
}

void FlaModel::init_random(uint64_t seed) {
  init_normal(*this, seed, 0.02f);
  init_decay_gates(*this, seed);
}

}  // namespace k3
