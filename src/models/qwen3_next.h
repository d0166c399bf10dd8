// Qwen3-Next (transformers' Qwen3NextForCausalLM): layers of Gated DeltaNet with grouped value
// heads (linear_attention) and gated softmax attention with partial RoPE (full_attention), as
// layer_types (or full_attention_interval) says; each followed by a MoE of softmax-routed SiLU GLU
// experts plus a shared expert scaled by its own sigmoid gate (or a dense GLU where
// mlp_only_layers / decoder_sparse_step say so). RMSNorms with zero-centred weights (1 + w).
// HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, linear_attn | self_attn,
// post_attention_layernorm, mlp}, model.norm, lm_head.
#pragma once

#include "blocks/block.h"
#include "models/model.h"

namespace k3 {

struct Qwen3NextConfig {
  std::string model_type = "qwen3_next";
  int64_t vocab_size = 151936, hidden_size = 2048, intermediate_size = 5120, moe_intermediate_size = 512;
  int64_t shared_expert_intermediate_size = 512;
  int64_t num_hidden_layers = 48, num_attention_heads = 16, num_key_value_heads = 2, head_dim = 256;
  int64_t linear_num_key_heads = 16, linear_num_value_heads = 32, linear_key_head_dim = 128,
          linear_value_head_dim = 128, linear_conv_kernel_dim = 4;
  int64_t num_experts = 512, num_experts_per_tok = 10, decoder_sparse_step = 1;
  std::optional<int64_t> full_attention_interval;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = true, attention_bias = false, tie_word_embeddings = false;
  double partial_rotary_factor = 0.25, rope_theta = 10000.0, rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 262144;
  std::string hidden_act = "silu";
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;

  template <class V>
  void fields(V& v) {
    v("model_type", model_type).one_of({"qwen3_next"});
    v("vocab_size", vocab_size, Presence::Required).positive().at_most(1 << 24);
    v("hidden_size", hidden_size, Presence::Required).positive().at_most(1 << 16);
    v("intermediate_size", intermediate_size).positive().at_most(1 << 20);
    v("moe_intermediate_size", moe_intermediate_size).positive().at_most(1 << 20);
    v("shared_expert_intermediate_size", shared_expert_intermediate_size).non_negative().at_most(1 << 20);
    v("num_hidden_layers", num_hidden_layers, Presence::Required).positive().at_most(4096);
    v("num_attention_heads", num_attention_heads, Presence::Required).positive().at_most(4096);
    v("num_key_value_heads", num_key_value_heads).positive().at_most(4096);
    v("head_dim", head_dim).positive().at_most(4096);
    v("linear_num_key_heads", linear_num_key_heads).positive().at_most(4096);
    v("linear_num_value_heads", linear_num_value_heads).positive().at_most(4096);
    v("linear_key_head_dim", linear_key_head_dim).positive().at_most(4096);
    v("linear_value_head_dim", linear_value_head_dim).positive().at_most(4096);
    v("linear_conv_kernel_dim", linear_conv_kernel_dim).positive().at_most(64);
    v("num_experts", num_experts).non_negative().at_most(1 << 16);
    v("num_experts_per_tok", num_experts_per_tok).positive();
    v("decoder_sparse_step", decoder_sparse_step).positive();
    v("full_attention_interval", full_attention_interval).positive();
    v("mlp_only_layers", mlp_only_layers).non_negative();
    v("norm_topk_prob", norm_topk_prob);
    v("attention_bias", attention_bias);
    v("tie_word_embeddings", tie_word_embeddings);
    v("partial_rotary_factor", partial_rotary_factor).in_range(0.0, 1.0);
    v("rope_theta", rope_theta).positive();
    v("rms_norm_eps", rms_norm_eps).positive();
    v("max_position_embeddings", max_position_embeddings).positive();
    v("hidden_act", hidden_act).one_of({"silu"});
    v("bos_token_id", bos_token_id).token_id(vocab_size);
    v("eos_token_id", eos_token_id).token_id(vocab_size);
    v("pad_token_id", pad_token_id).token_id(vocab_size);
  }
};

class Qwen3NextModel final : public Model {
 public:
  Qwen3NextModel(const Qwen3NextConfig& c, const Json& raw, const std::string& where);
  static std::unique_ptr<Model> from_config(const Json& j, const std::string& where);
  static std::unique_ptr<Model> load(const std::string& dir, const Json& j, const LoadPlan& plan);

  std::string architecture() const override { return "qwen3_next"; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.max_position_embeddings; }
  int64_t num_layers() const override { return c_.num_hidden_layers; }
  void visit(const ParamVisitor& v) const override;
  Json config_json() const override { return raw_; }
  std::vector<LayerMemory> memory_layers() const override { return blocks_.memory_layers(); }
  Context new_context(int64_t max_tokens) const override { return blocks_.new_context(max_tokens); }
  Var hidden(const TokenBatch& batch) const override;
  Var head_weight() const override { return lm_head_; }
  void init_random(uint64_t seed) override;
  int64_t active_params() const override;
  double idle_expert_params(int64_t tokens) const override { return blocks_.idle_expert_params(tokens); }
  Var aux_loss(int64_t seq_len, float alpha) const override { return blocks_.balance_loss(seq_len, alpha); }

 private:
  Qwen3NextConfig c_;
  Json raw_;
  Var embed_, lm_head_;
  BlockStack blocks_;
  Norm norm_;
};

}  // namespace k3
