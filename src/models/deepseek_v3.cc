#include "models/deepseek_v3.h"

#include <cstdio>

#include "ffn/glu.h"
#include "ffn/moe.h"
#include "mixers/mla/mla.h"
#include "models/init.h"
#include "ops/ag.h"

namespace k3 {

namespace {
// rope_parameters (transformers 5) or rope_scaling (older configs), every field typed and checked.
struct RopeParameters {
  std::optional<double> rope_theta, attention_factor;
  std::string rope_type, type;
  double factor = 1.0, beta_fast = 32.0, beta_slow = 1.0, mscale = 1.0, mscale_all_dim = 0.0;
  int64_t original_max_position_embeddings = 4096;
  template <class V>
  void fields(V& v) {
    v("rope_theta", rope_theta).positive();
    v("rope_type", rope_type);
    v("type", type);
    v("factor", factor).positive();
    v("original_max_position_embeddings", original_max_position_embeddings).positive();
    v("beta_fast", beta_fast).positive();
    v("beta_slow", beta_slow).positive();
    v("mscale", mscale).non_negative();
    v("mscale_all_dim", mscale_all_dim).non_negative();
    v("attention_factor", attention_factor).positive();
  }
};

// YaRN from rope_parameters or rope_scaling; *theta takes their rope_theta where present.
std::optional<YarnScaling> read_yarn(const Json& j, double* theta, const std::string& where) {
  const char* key = nullptr;
  for (const char* k : {"rope_parameters", "rope_scaling"})
    if (j.contains(k) && !j[k].is_null()) {
      key = k;
      break;
    }
  if (!key) return std::nullopt;
  const auto rp = read_config<RopeParameters>(j[key], where + " (" + key + ")");
  if (rp.rope_theta) *theta = *rp.rope_theta;
  const std::string type = !rp.rope_type.empty() ? rp.rope_type : !rp.type.empty() ? rp.type : "default";
  if (type == "default") return std::nullopt;
  if (type != "yarn") throw error("config", where, ": ", key, ".rope_type '", type, "' is not supported (default or yarn)");
  if (rp.beta_fast <= rp.beta_slow)
    throw error("config", where, ": ", key, ".beta_fast ", rp.beta_fast, " must exceed beta_slow ", rp.beta_slow);
  YarnScaling y;
  y.factor = rp.factor;
  y.original_max_position_embeddings = rp.original_max_position_embeddings;
  y.beta_fast = rp.beta_fast;
  y.beta_slow = rp.beta_slow;
  y.mscale = rp.mscale;
  y.mscale_all_dim = rp.mscale_all_dim;
  if (rp.attention_factor) y.attention_factor = *rp.attention_factor;
  return y;
}
}  // namespace

DeepseekV3Model::DeepseekV3Model(const DeepseekV3Config& c, const Json& raw, bool with_mtp) : c_(c), raw_(raw) {
  const int64_t D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  double theta = c.rope_theta;
  auto yarn = read_yarn(raw, &theta, "deepseek_v3 config");
  embed_ = parameter({c.vocab_size, D});
  lm_head_ = c.tie_word_embeddings ? embed_ : parameter({c.vocab_size, D});
  auto block = [&](int64_t l) {
    MlaOptions mo;
    mo.d_model = D;
    mo.heads = c.num_attention_heads;
    mo.q_lora_rank = c.q_lora_rank;
    mo.kv_lora_rank = c.kv_lora_rank;
    mo.qk_nope_head_dim = c.qk_nope_head_dim;
    mo.qk_rope_head_dim = c.qk_rope_head_dim;
    mo.v_head_dim = c.v_head_dim;
    mo.latent_norm_eps = eps;  // HF DeepseekV3: q_a_layernorm / kv_a_layernorm use rms_norm_eps
    mo.position = MlaPosition::Rope;
    mo.rope_theta = theta;
    mo.yarn = yarn;
    mo.max_positions = c.max_position_embeddings;
    std::unique_ptr<Ffn> ffn;
    if (l < c.first_k_dense_replace) {
      ffn = std::make_unique<GluMlp>(D, c.intermediate_size, GluOptions{});
    } else {
      MoeOptions o;
      o.d_model = D;
      o.n_experts = c.n_routed_experts;
      o.top_k = c.num_experts_per_tok;
      o.expert_hidden = c.moe_intermediate_size;
      o.n_shared = c.n_shared_experts;
      o.n_group = c.n_group;
      o.topk_group = c.topk_group;
      o.routed_scaling = float(c.routed_scaling_factor);
      o.renormalize = c.norm_topk_prob ? Renormalize::Yes : Renormalize::No;
      o.names = MoeNames::deepseek();
      ffn = std::make_unique<MoE>(o);
    }
    return PreNormBlock(Norm(NormType::RMSNorm, D, eps), std::make_unique<Mla>(mo), Norm(NormType::RMSNorm, D, eps),
                        std::move(ffn), BlockNames{"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"});
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) blocks_.add(block(l));
  norm_ = Norm(NormType::RMSNorm, D, eps);
  if (with_mtp) {
    if (c.num_nextn_predict_layers < 1)
      throw error("config", "deepseek_v3: a multi-token-prediction layer needs num_nextn_predict_layers >= 1");
    mtp_.emplace(block(c.num_hidden_layers), D, c.vocab_size, eps, embed_);
  }
  eos_token_id = c.eos_token_id;
}

std::unique_ptr<Model> DeepseekV3Model::build(const Json& j, const std::string& where, bool with_mtp) {
  auto c = read_config<DeepseekV3Config>(j, where);
  if (c.num_experts_per_tok > c.n_routed_experts || c.topk_group > c.n_group || c.n_routed_experts % c.n_group != 0)
    throw error("config", where, ": inconsistent routing (top-", c.num_experts_per_tok, " of ", c.n_routed_experts,
                " experts in ", c.n_group, " groups, top ", c.topk_group, " groups)");
  return std::make_unique<DeepseekV3Model>(c, j, with_mtp);
}

std::unique_ptr<Model> DeepseekV3Model::load(const std::string& dir, const Json& j, const LoadPlan& plan) {
  const Checkpoint ckpt = Checkpoint::open(dir);
  // The multi-token-prediction layers sit after the model's; the first is loaded where the
  // checkpoint has it, the others (and its copy of the embedding) are left unread.
  const std::string where = dir + "/config.json";
  const auto c = read_config<DeepseekV3Config>(j, where);
  const std::string mtp = "model.layers." + std::to_string(c.num_hidden_layers) + ".";
  auto m = build(j, where, c.num_nextn_predict_layers > 0 && ckpt.has(mtp + "eh_proj.weight"));
  LoadOptions opts;
  opts.plan = plan;
  const int64_t first_extra = c.num_hidden_layers + 1;
  opts.ignorable = [mtp, first_extra](const std::string& n) {
    if (n.find("rotary_emb") != std::string::npos || n == mtp + "embed_tokens.weight") return true;
    int64_t l = -1;
    return std::sscanf(n.c_str(), "model.layers.%ld.", &l) == 1 && l >= first_extra;
  };
  load_params(*m, ckpt, opts);
  return m;
}

void DeepseekV3Model::visit(const ParamVisitor& v) const {
  v("model.embed_tokens.weight", *embed_, ParamKind::Embedding);
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l].visit("model.layers." + std::to_string(l), v);
  norm_.visit("model.norm", v);
  if (!c_.tie_word_embeddings) v("lm_head.weight", *lm_head_, ParamKind::Weight);
  if (mtp_) mtp_->visit("model.layers." + std::to_string(c_.num_hidden_layers), v);
}

std::vector<LayerMemory> DeepseekV3Model::memory_layers() const { return blocks_.memory_layers(); }

Context DeepseekV3Model::new_context(int64_t max_tokens) const { return blocks_.new_context(max_tokens); }

Var DeepseekV3Model::hidden(const TokenBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  Var x = ag::embedding(embed_, std::vector<int64_t>(batch.ids, batch.ids + B * T), c_.pad_token_id);
  x = blocks_.forward(x, B, T, batch.contexts);
  return norm_(x);
}

void DeepseekV3Model::init_random(uint64_t seed) { init_normal(*this, seed, 0.02f); }

int64_t DeepseekV3Model::active_params() const {
  return total_params() - embed_->value.numel() - blocks_.idle_expert_params();
}

void DeepseekV3Model::after_step() const { blocks_.balance_experts(1e-3f); }

}  // namespace k3
