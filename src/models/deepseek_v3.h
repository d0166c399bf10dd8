// DeepSeek-V3 (spec §6, §8.1): MLA with decoupled RoPE (YaRN where the config asks), dense SiLU
// GLU for the first layers, then MoE with sigmoid routing, grouped top-k and a selection-only
// correction bias. HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn,
// post_attention_layernorm, mlp}, model.norm, lm_head; the multi-token-prediction layer, where the
// checkpoint has one, under model.layers.{num_hidden_layers} (models/mtp.h).
#pragma once

#include "blocks/block.h"
#include "models/model.h"
#include "models/mtp.h"

namespace k3 {

struct DeepseekV3Config {
  std::string model_type = "deepseek_v3";
  int64_t vocab_size = 129280, hidden_size = 7168, intermediate_size = 18432, moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 61, num_attention_heads = 128;
  std::optional<int64_t> q_lora_rank = 1536;
  int64_t kv_lora_rank = 512, qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128;
  int64_t n_routed_experts = 256, n_shared_experts = 1, num_experts_per_tok = 8, n_group = 8, topk_group = 4;
  int64_t first_k_dense_replace = 3;
  int64_t num_nextn_predict_layers = 0;
  double routed_scaling_factor = 2.5;
  bool norm_topk_prob = true;
  int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  std::string hidden_act = "silu";
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;

  template <class V>
  void fields(V& v) {
    v("model_type", model_type).one_of({"deepseek_v3"});
    v("vocab_size", vocab_size, Presence::Required).positive().at_most(1 << 24);
    v("hidden_size", hidden_size, Presence::Required).positive().at_most(1 << 16);
    v("intermediate_size", intermediate_size).positive().at_most(1 << 20);
    v("moe_intermediate_size", moe_intermediate_size).positive().at_most(1 << 20);
    v("num_hidden_layers", num_hidden_layers, Presence::Required).positive().at_most(4096);
    v("num_attention_heads", num_attention_heads, Presence::Required).positive().at_most(4096);
    v("q_lora_rank", q_lora_rank).positive().at_most(1 << 16);
    v("kv_lora_rank", kv_lora_rank).positive().at_most(1 << 16);
    v("qk_nope_head_dim", qk_nope_head_dim).positive().at_most(4096);
    v("qk_rope_head_dim", qk_rope_head_dim).non_negative().at_most(4096);
    v("v_head_dim", v_head_dim).positive().at_most(4096);
    v("n_routed_experts", n_routed_experts).positive().at_most(1 << 16);
    v("n_shared_experts", n_shared_experts).non_negative().at_most(64);
    v("num_experts_per_tok", num_experts_per_tok).positive().at_most(double(n_routed_experts));
    v("n_group", n_group).positive();
    v("topk_group", topk_group).positive().at_most(double(n_group));
    v("first_k_dense_replace", first_k_dense_replace).non_negative();
    v("num_nextn_predict_layers", num_nextn_predict_layers).non_negative().at_most(64);
    v("routed_scaling_factor", routed_scaling_factor).positive();
    v("norm_topk_prob", norm_topk_prob);
    v("max_position_embeddings", max_position_embeddings).positive();
    v("rms_norm_eps", rms_norm_eps).positive();
    v("rope_theta", rope_theta).positive();
    v("hidden_act", hidden_act).one_of({"silu"});
    v("tie_word_embeddings", tie_word_embeddings);
    v("bos_token_id", bos_token_id).token_id(vocab_size);
    v("eos_token_id", eos_token_id).token_id(vocab_size);
    v("pad_token_id", pad_token_id).token_id(vocab_size);
  }
};

class DeepseekV3Model final : public Model {
 public:
  // with_mtp: the first multi-token-prediction layer too (the config must name at least one).
  DeepseekV3Model(const DeepseekV3Config& c, const Json& raw, bool with_mtp = false);
  static std::unique_ptr<Model> from_config(const Json& j, const std::string& where) { return build(j, where, false); }
  static std::unique_ptr<Model> build(const Json& j, const std::string& where, bool with_mtp);
  static std::unique_ptr<Model> load(const std::string& dir, const Json& j, const LoadPlan& plan);

  std::string architecture() const override { return "deepseek_v3"; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.max_position_embeddings; }
  int64_t num_layers() const override { return c_.num_hidden_layers; }
  void visit(const ParamVisitor& v) const override;
  Json config_json() const override { return raw_; }
  std::vector<LayerMemory> memory_layers() const override;
  Context new_context(int64_t max_tokens) const override;
  Var hidden(const TokenBatch& batch) const override;
  Var head_weight() const override { return lm_head_; }
  const MtpHead* mtp() const override { return mtp_ ? &*mtp_ : nullptr; }
  void init_random(uint64_t seed) override;
  int64_t active_params() const override;
  double idle_expert_params(int64_t tokens) const override { return blocks_.idle_expert_params(tokens); }
  void after_step() const override;
  Var aux_loss(int64_t seq_len, float alpha) const override { return blocks_.balance_loss(seq_len, alpha); }

 private:
  DeepseekV3Config c_;
  Json raw_;
  Var embed_, lm_head_;
  BlockStack blocks_;
  Norm norm_;
  std::optional<MtpHead> mtp_;
};

}  // namespace k3
