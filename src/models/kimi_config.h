// The Kimi text-model config (model_type kimi_linear, also K3's text_config; spec §5.5, §11),
// one declaration per field. K3 wraps it as {"model_type": "kimi_k3", "text_config": {...}}.
#pragma once

#include "io/config.h"

namespace k3 {

struct KimiLinearAttnConfig {
  int64_t num_heads = 32;
  int64_t head_dim = 128;
  int64_t short_conv_kernel_size = 4;
  bool use_full_rank_gate = false;
  std::optional<double> gate_lower_bound;  // K3: -5
  std::vector<int64_t> kda_layers;         // 1-based (spec §0)
  std::vector<int64_t> full_attn_layers;   // 1-based

  template <class V>
  void fields(V& v) {
    v("num_heads", num_heads, Presence::Required).positive().at_most(4096);
    v("head_dim", head_dim, Presence::Required).positive().at_most(4096);
    v("short_conv_kernel_size", short_conv_kernel_size).positive();
    v("use_full_rank_gate", use_full_rank_gate);
    v("gate_lower_bound", gate_lower_bound);
    v("kda_layers", kda_layers, Presence::Required).positive();
    v("full_attn_layers", full_attn_layers, Presence::Required).positive();
  }
};

struct KimiConfig {
  std::string model_type = "kimi_linear";
  int64_t vocab_size = 163840;
  int64_t hidden_size = 2304;
  int64_t num_hidden_layers = 27;
  int64_t max_position_embeddings = 1 << 20;
  double rms_norm_eps = 1e-5;
  std::string hidden_act = "silu";
  std::optional<double> activation_situ_beta;
  std::optional<double> activation_situ_linear_beta;
  int64_t intermediate_size = 9216;
  int64_t first_k_dense_replace = 1;
  int64_t moe_layer_freq = 1;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  std::optional<int64_t> q_lora_rank;
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  bool mla_use_nope = true;
  bool mla_use_output_gate = false;
  std::optional<int64_t> num_experts;
  int64_t num_experts_per_token = 8;
  int64_t num_shared_experts = 1;
  int64_t moe_intermediate_size = 1024;
  std::optional<int64_t> routed_expert_hidden_size;  // latent MoE width (K3)
  bool latent_moe_use_norm = false;
  std::string moe_router_activation_func = "sigmoid";
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  std::optional<int64_t> attn_res_block_size;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
  KimiLinearAttnConfig linear_attn_config;

  template <class V>
  void fields(V& v) {
    v("model_type", model_type);
    v("vocab_size", vocab_size, Presence::Required).positive().at_most(1 << 24);
    v("hidden_size", hidden_size, Presence::Required).positive().at_most(1 << 16);
    v("num_hidden_layers", num_hidden_layers, Presence::Required).positive().at_most(4096);
    v("max_position_embeddings", max_position_embeddings).positive();
    v("rms_norm_eps", rms_norm_eps).positive();
    v("hidden_act", hidden_act).one_of({"silu", "situ"});
    v("activation_situ_beta", activation_situ_beta).positive();
    v("activation_situ_linear_beta", activation_situ_linear_beta).positive();
    v("intermediate_size", intermediate_size).positive().at_most(1 << 20);
    v("first_k_dense_replace", first_k_dense_replace).non_negative();
    v("moe_layer_freq", moe_layer_freq).positive();
    v("num_attention_heads", num_attention_heads, Presence::Required).positive().at_most(4096);
    v("num_key_value_heads", num_key_value_heads).positive().at_most(4096);
    v("q_lora_rank", q_lora_rank).positive().at_most(1 << 16);
    v("kv_lora_rank", kv_lora_rank).positive().at_most(1 << 16);
    v("qk_nope_head_dim", qk_nope_head_dim).positive().at_most(4096);
    v("qk_rope_head_dim", qk_rope_head_dim).non_negative().at_most(4096);
    v("v_head_dim", v_head_dim).positive().at_most(4096);
    v("mla_use_nope", mla_use_nope);
    v("mla_use_output_gate", mla_use_output_gate);
    v("num_experts", num_experts).positive().at_most(1 << 16);
    v("num_experts_per_token", num_experts_per_token).positive().at_most(double(num_experts.value_or(1 << 16)));
    v("num_shared_experts", num_shared_experts).non_negative().at_most(64);
    v("moe_intermediate_size", moe_intermediate_size).positive().at_most(1 << 20);
    v("routed_expert_hidden_size", routed_expert_hidden_size).positive().at_most(1 << 16);
    v("latent_moe_use_norm", latent_moe_use_norm);
    v("moe_router_activation_func", moe_router_activation_func).one_of({"sigmoid", "softmax"});
    v("moe_renormalize", moe_renormalize);
    v("routed_scaling_factor", routed_scaling_factor).positive();
    v("num_expert_group", num_expert_group).positive();
    v("topk_group", topk_group).positive().at_most(double(num_expert_group));
    v("attn_res_block_size", attn_res_block_size).positive();
    v("tie_word_embeddings", tie_word_embeddings);
    v("bos_token_id", bos_token_id).token_id(vocab_size);
    v("eos_token_id", eos_token_id).token_id(vocab_size);
    v("pad_token_id", pad_token_id).token_id(vocab_size);
  }

  // 0-based layer l is KDA iff (l+1) is in kda_layers (spec §0).
  bool is_kda_layer(int64_t l) const;
  bool is_moe_layer(int64_t l) const;
};

// Reads a kimi_linear config, or a kimi_k3 config's text_config.
KimiConfig read_kimi_config(const Json& j, const std::string& where);

}  // namespace k3
