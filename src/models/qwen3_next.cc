#include "models/qwen3_next.h"

#include <algorithm>
#include <cmath>

#include "ffn/glu.h"
#include "ffn/moe.h"
#include "mixers/attention/gated_attention.h"
#include "mixers/linear/delta_layer.h"
#include "models/init.h"
#include "ops/ag.h"

namespace k3 {

namespace {
// Which layers are full attention: layer_types where the config lists them, else every
// full_attention_interval-th layer (older configs).
std::vector<bool> full_attention_layers(const Qwen3NextConfig& c, const Json& j, const std::string& where) {
  std::vector<bool> full(size_t(c.num_hidden_layers), false);
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const Json& lt = j["layer_types"];
    if (!lt.is_array() || int64_t(lt.size()) != c.num_hidden_layers)
      throw error("config", where, ": layer_types should list one type per layer (", c.num_hidden_layers,
                  "), got ", lt.dump());
    for (size_t l = 0; l < lt.size(); ++l) {
      const std::string t = lt[l].is_string() ? lt[l].get<std::string>() : lt[l].dump();
      if (t != "linear_attention" && t != "full_attention")
        throw error("config", where, ": layer_types[", l, "] = \"", t,
                    "\" is not supported (expected linear_attention or full_attention)");
      full[l] = t == "full_attention";
    }
    return full;
  }
  const int64_t every = c.full_attention_interval.value_or(4);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) full[size_t(l)] = (l + 1) % every == 0;
  return full;
}

// rope_parameters (transformers 5): rope_theta and partial_rotary_factor; default RoPE only.
void read_rope(const Json& j, const std::string& where, double& theta, double& partial) {
  if (!j.contains("rope_parameters") || j["rope_parameters"].is_null()) return;
  const Json& rp = j["rope_parameters"];
  if (!rp.is_object()) throw error("config", where, ": rope_parameters should be an object, got ", rp.dump());
  if (rp.contains("rope_type") && rp["rope_type"] != "default")
    throw error("config", where, ": rope_parameters.rope_type ", rp["rope_type"].dump(),
                " is not supported for qwen3_next (default only)");
  if (rp.contains("rope_theta")) {
    if (!rp["rope_theta"].is_number() || rp["rope_theta"].get<double>() <= 0)
      throw error("config", where, ": rope_parameters.rope_theta must be a positive number");
    theta = rp["rope_theta"].get<double>();
  }
  if (rp.contains("partial_rotary_factor")) {
    if (!rp["partial_rotary_factor"].is_number()) throw error("config", where, ": partial_rotary_factor must be a number");
    partial = rp["partial_rotary_factor"].get<double>();
    if (partial < 0 || partial > 1) throw error("config", where, ": partial_rotary_factor ", partial, " is not in [0, 1]");
  }
}
}  // namespace

Qwen3NextModel::Qwen3NextModel(const Qwen3NextConfig& c, const Json& raw, const std::string& where)
    : c_(c), raw_(raw) {
  const int64_t D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  if (c.attention_bias) throw error("config", where, ": attention_bias true is not supported for qwen3_next");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw error("config", where, ": ", c.num_attention_heads, " attention heads cannot share ", c.num_key_value_heads,
                " key/value heads");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    throw error("config", where, ": ", c.linear_num_value_heads, " value heads are not groups of the ",
                c.linear_num_key_heads, " key heads");
  if (c.num_experts > 0 && c.num_experts_per_tok > c.num_experts)
    throw error("config", where, ": top-", c.num_experts_per_tok, " of ", c.num_experts, " experts");
  double theta = c.rope_theta, partial = c.partial_rotary_factor;
  read_rope(raw, where, theta, partial);
  const std::vector<bool> full = full_attention_layers(c, raw, where);
  const int64_t rope_dim = int64_t(double(c.head_dim) * partial) / 2 * 2;

  embed_ = parameter({c.vocab_size, D});
  lm_head_ = c.tie_word_embeddings ? embed_ : parameter({c.vocab_size, D});
  auto zc_norm = [&] { return Norm(NormType::RMSNorm, D, eps, NormWeight::ZeroCentred); };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::unique_ptr<Mixer> mixer;
    std::string mixer_name;
    if (full[size_t(l)]) {
      GatedAttentionOptions a;
      a.d_model = D;
      a.heads = c.num_attention_heads;
      a.kv_heads = c.num_key_value_heads;
      a.head_dim = c.head_dim;
      a.rope_dim = rope_dim;
      a.rope_theta = theta;
      a.max_positions = c.max_position_embeddings;
      a.eps = eps;
      mixer = std::make_unique<GatedAttention>(a);
      mixer_name = "self_attn";
    } else {
      mixer = std::make_unique<DeltaLayer>(DeltaLayerOptions::qwen3_next_gdn(
          D, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
          c.linear_conv_kernel_dim, eps));
      mixer_name = "linear_attn";
    }
    const bool sparse = c.num_experts > 0 && (l + 1) % c.decoder_sparse_step == 0 &&
                        std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), l) == c.mlp_only_layers.end();
    std::unique_ptr<Ffn> ffn;
    if (sparse) {
      MoeOptions o;
      o.d_model = D;
      o.n_experts = c.num_experts;
      o.top_k = c.num_experts_per_tok;
      o.expert_hidden = c.moe_intermediate_size;
      o.n_shared = c.shared_expert_intermediate_size > 0 ? 1 : 0;
      o.shared_hidden = c.shared_expert_intermediate_size;
      o.shared_gate = c.shared_expert_intermediate_size > 0 ? SharedGate::Sigmoid : SharedGate::None;
      o.score = ScoreFunction::Softmax;
      o.bias = SelectionBias::None;
      o.renormalize = c.norm_topk_prob ? Renormalize::Yes : Renormalize::No;
      o.names = MoeNames::qwen3_next();
      ffn = std::make_unique<MoE>(o);
    } else {
      ffn = std::make_unique<GluMlp>(D, c.intermediate_size, GluOptions{});
    }
    blocks_.add(PreNormBlock(zc_norm(), std::move(mixer), zc_norm(), std::move(ffn),
                             BlockNames{"input_layernorm", mixer_name, "post_attention_layernorm", "mlp"}));
  }
  norm_ = zc_norm();
  eos_token_id = c.eos_token_id;
}

std::unique_ptr<Model> Qwen3NextModel::from_config(const Json& j, const std::string& where) {
  return std::make_unique<Qwen3NextModel>(read_config<Qwen3NextConfig>(j, where), j, where);
}

std::unique_ptr<Model> Qwen3NextModel::load(const std::string& dir, const Json& j, const LoadPlan& plan) {
  auto m = from_config(j, dir + "/config.json");
  LoadOptions opts;
  opts.plan = plan;
  // Multi-token-prediction weights (mtp.*) are not used.
  opts.ignorable = [](const std::string& n) { return n.starts_with("mtp.") || n.find("rotary_emb") != std::string::npos; };
  load_params(*m, Checkpoint::open(dir), opts);
  return m;
}

void Qwen3NextModel::visit(const ParamVisitor& v) const {
  v("model.embed_tokens.weight", *embed_, ParamKind::Embedding);
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l].visit("model.layers." + std::to_string(l), v);
  norm_.visit("model.norm", v);
  if (!c_.tie_word_embeddings) v("lm_head.weight", *lm_head_, ParamKind::Weight);
}

Var Qwen3NextModel::hidden(const TokenBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  Var x = ag::embedding(embed_, std::vector<int64_t>(batch.ids, batch.ids + B * T));
  x = blocks_.forward(x, B, T, batch.contexts);
  return norm_(x);
}

void Qwen3NextModel::init_random(uint64_t seed) {
  init_normal(*this, seed, 0.02f);
  init_decay_gates(*this, seed);
}

int64_t Qwen3NextModel::active_params() const {
  return total_params() - embed_->value.numel() - blocks_.idle_expert_params();
}

}  // namespace k3
