#include "models/kimi.h"

#include <cmath>
#include <optional>

#include "core/profile.h"
#include "core/random.h"
#include "ffn/glu.h"
#include "ffn/moe.h"
#include "mixers/linear/delta_layer.h"
#include "mixers/mla/mla.h"
#include "models/init.h"
#include "ops/ag.h"

namespace k3 {

namespace {

// K3 joins its layers by block Attention Residuals (HF names of the mixes), Kimi Linear by plain sums.
BlockStack residual_rule(const KimiConfig& c, KimiFlavor f) {
  if (f != KimiFlavor::K3) return BlockStack();
  if (!c.attn_res_block_size) throw error("config", "kimi_k3 needs attn_res_block_size");
  AttnResidual r;
  r.block_size = *c.attn_res_block_size;
  r.D = c.hidden_size;
  r.eps = float(c.rms_norm_eps);
  r.names = {"self_attention_res_proj", "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm",
             "output_attn_res_proj",    "output_attn_res_norm"};
  return BlockStack(r);
}

std::unique_ptr<Mixer> make_mixer(const KimiConfig& c, KimiFlavor f, int64_t l, int64_t a_log_size) {
  const int64_t D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  const auto& la = c.linear_attn_config;
  if (c.is_kda_layer(l)) {
    DeltaLayerOptions o = f == KimiFlavor::K3 ? DeltaLayerOptions::kimi_k3_kda(D, la.num_heads, la.head_dim, eps)
                                              : DeltaLayerOptions::kimi_linear_kda(D, la.num_heads, la.head_dim, eps);
    o.conv_size = la.short_conv_kernel_size;
    if (la.gate_lower_bound) {
      o.gate_form = ag::KdaGateForm::LowerBound;
      o.gate_lower_bound = float(*la.gate_lower_bound);
    }
    o.output_gate = la.use_full_rank_gate ? DeltaOutputGate::FullRank : DeltaOutputGate::KimiLowRank;
    if (f == KimiFlavor::K3 && a_log_size > 0) o.a_log_shape = {a_log_size};
    return std::make_unique<DeltaLayer>(o);
  }
  MlaOptions m;
  m.d_model = D;
  m.heads = c.num_attention_heads;
  m.q_lora_rank = c.q_lora_rank;
  m.kv_lora_rank = c.kv_lora_rank;
  m.qk_nope_head_dim = c.qk_nope_head_dim;
  m.qk_rope_head_dim = c.qk_rope_head_dim;
  m.v_head_dim = c.v_head_dim;
  m.latent_norm_eps = 1e-6f;  // HF KimiRMSNorm default for q_a/kv_a layernorms (spec §12.6)
  m.position = c.mla_use_nope ? MlaPosition::NoPE : MlaPosition::Rope;
  m.gate = c.mla_use_output_gate ? OutputGate::Sigmoid : OutputGate::None;
  m.max_positions = c.max_position_embeddings;
  return std::make_unique<Mla>(m);
}

GluOptions glu_options(const KimiConfig& c) {
  GluOptions g;
  if (c.hidden_act == "situ") {
    g.activation = GluActivation::SiTU;
    g.situ = SituOptions{c.activation_situ_beta ? std::optional<float>(float(*c.activation_situ_beta)) : std::nullopt,
                         c.activation_situ_linear_beta ? std::optional<float>(float(*c.activation_situ_linear_beta))
                                                       : std::nullopt};
  }
  return g;
}

std::unique_ptr<Ffn> make_ffn(const KimiConfig& c, int64_t l) {
  GluOptions g = glu_options(c);
  if (!c.is_moe_layer(l)) return std::make_unique<GluMlp>(c.hidden_size, c.intermediate_size, g);
  MoeOptions o;
  o.d_model = c.hidden_size;
  o.n_experts = *c.num_experts;
  o.top_k = c.num_experts_per_token;
  o.expert_hidden = c.moe_intermediate_size;
  o.n_shared = c.num_shared_experts;
  o.n_group = c.num_expert_group;
  o.topk_group = c.topk_group;
  o.routed_scaling = float(c.routed_scaling_factor);
  o.renormalize = c.moe_renormalize ? Renormalize::Yes : Renormalize::No;
  o.score = c.moe_router_activation_func == "softmax" ? ScoreFunction::Softmax : ScoreFunction::Sigmoid;
  // Combine weights are the unbiased scores: the kimi-linear-tiny fixture (transformers 5.17)
  // matches them, not the in-place-aliased biased weights of the original remote-code file
  // (spec §8.1, §12.5).
  o.combine = CombineWeights::Unbiased;
  if (c.routed_expert_hidden_size) {
    o.latent_dim = *c.routed_expert_hidden_size;
    o.latent_norm = c.latent_moe_use_norm ? LatentNorm::RMSNorm : LatentNorm::None;
    o.norm_eps = float(c.rms_norm_eps);
  }
  o.activation = g.activation;
  o.situ = g.situ;
  o.names = MoeNames::kimi();
  return std::make_unique<MoE>(o);
}

void validate(const KimiConfig& c, const std::string& where) {
  if (c.num_experts) {
    if (c.num_experts_per_token > *c.num_experts)
      throw error("config", where, ": num_experts_per_token ", c.num_experts_per_token, " > num_experts ", *c.num_experts);
    if (c.topk_group > c.num_expert_group || *c.num_experts % c.num_expert_group != 0)
      throw error("config", where, ": inconsistent expert groups");
  }
}

}  // namespace

KimiModel::KimiModel(const KimiConfig& c, KimiFlavor f, const Json& raw, int64_t a_log_size)
    : c_(c), flavor_(f), raw_(raw), blocks_(residual_rule(c, f)) {
  const int64_t D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  embed_ = parameter({c.vocab_size, D});
  lm_head_ = c.tie_word_embeddings ? embed_ : parameter({c.vocab_size, D});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // Kimi-Linear's HF file names the dense layer-0 MLP "block_sparse_moe" too; K3 names it "mlp".
    std::string ffn_name = c.is_moe_layer(l) || f == KimiFlavor::Linear ? "block_sparse_moe" : "mlp";
    blocks_.add(PreNormBlock(Norm(NormType::RMSNorm, D, eps), make_mixer(c, f, l, a_log_size), Norm(NormType::RMSNorm, D, eps),
                             make_ffn(c, l), BlockNames{"input_layernorm", "self_attn", "post_attention_layernorm", ffn_name}));
  }
  norm_ = Norm(NormType::RMSNorm, D, eps);
  eos_token_id = c.eos_token_id;
}

std::unique_ptr<Model> KimiModel::linear_from_config(const Json& j, const std::string& where) {
  KimiConfig c = read_kimi_config(j, where);
  validate(c, where);
  return std::make_unique<KimiModel>(c, KimiFlavor::Linear, j, 0);
}

std::unique_ptr<Model> KimiModel::k3_from_config(const Json& j, const std::string& where) {
  KimiConfig c = read_kimi_config(j, where);
  validate(c, where);
  if (!c.attn_res_block_size) throw error("config", where, ": kimi_k3 needs attn_res_block_size");
  return std::make_unique<KimiModel>(c, KimiFlavor::K3, j, 0);
}

std::unique_ptr<Model> KimiModel::load(const std::string& dir, const Json& j, const LoadPlan& plan) {
  const std::string where = dir + "/config.json";
  const bool k3 = j.value("model_type", "") == "kimi_k3";
  KimiConfig c = read_kimi_config(j, where);
  validate(c, where);
  Checkpoint ckpt = Checkpoint::open(dir);
  // K3's A_log is [H] as published; some exports store it per channel ([H*K]) with the per-head
  // values first. Read the size from the first KDA layer of the checkpoint.
  int64_t a_log_size = 0;
  for (int64_t l = 0; k3 && l < c.num_hidden_layers; ++l)
    if (c.is_kda_layer(l)) {
      std::string n = "language_model.model.layers." + std::to_string(l) + ".self_attn.A_log";
      if (ckpt.has(n)) a_log_size = shape_numel(ckpt.entry(n).shape);
      break;
    }
  if (!k3 && c.attn_res_block_size) throw error("config", where, ": attn_res_block_size is a kimi_k3 feature");
  auto m = std::make_unique<KimiModel>(c, k3 ? KimiFlavor::K3 : KimiFlavor::Linear, j, a_log_size);
  load_params(*m, ckpt, LoadOptions{.alias = {}, .ignorable = {}, .plan = plan});
  return m;
}

void KimiModel::visit(const ParamVisitor& v) const {
  const std::string p = prefix();
  v(p + "model.embed_tokens.weight", *embed_, ParamKind::Embedding);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const std::string lp = p + "model.layers." + std::to_string(l);
    blocks_.visit_layer(l, lp, v);
  }
  blocks_.visit_stack(p + "model", v);
  norm_.visit(p + "model.norm", v);
  if (!c_.tie_word_embeddings) v(p + "lm_head.weight", *lm_head_, ParamKind::Weight);
}

std::vector<LayerMemory> KimiModel::memory_layers() const { return blocks_.memory_layers(); }

Context KimiModel::new_context(int64_t max_tokens) const { return blocks_.new_context(max_tokens); }

Var KimiModel::hidden(const TokenBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  std::optional<profile::Scope> scope(std::in_place, "embedding");
  Var x = ag::embedding(embed_, std::vector<int64_t>(batch.ids, batch.ids + B * T), c_.pad_token_id);
  scope.reset();
  x = blocks_.forward(x, B, T, batch.contexts);  // plain residuals, or K3's Attention Residuals
  const profile::Scope norm("final norm");
  return norm_(x);
}

void KimiModel::init_random(uint64_t seed) {
  init_normal(*this, seed, 0.02f);
  init_decay_gates(*this, seed);
}

int64_t KimiModel::active_params() const {
  return total_params() - embed_->value.numel() - blocks_.idle_expert_params();
}

void KimiModel::after_step() const { blocks_.balance_experts(1e-3f); }

}  // namespace k3
