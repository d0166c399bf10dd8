#include "models/presets.h"

namespace k3 {

namespace {

Json gpt2_config(int64_t vocab, int64_t positions, int64_t d, int64_t layers, int64_t heads) {
  return Json{{"model_type", "gpt2"},   {"architectures", {"GPT2LMHeadModel"}},
              {"vocab_size", vocab},    {"n_positions", positions},
              {"n_embd", d},            {"n_layer", layers},
              {"n_head", heads},        {"n_inner", nullptr},
              {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"},
              {"tie_word_embeddings", true}, {"bos_token_id", 50256},
              {"eos_token_id", 50256}};
}

// Kimi K3's published text_config (spec §11). `layers` = 93 (published) or 92 (the article's
// 23 macrocycles of 3 KDA + 1 MLA).
Json kimi_k3_config(int64_t layers) {
  std::vector<int64_t> full, kda;
  for (int64_t l = 1; l <= layers; ++l) {
    bool is_full = l % 4 == 0 || (layers == 93 && l == 93);
    (is_full ? full : kda).push_back(l);
  }
  Json text = {
      {"model_type", "kimi_linear"},
      {"vocab_size", 163840},
      {"hidden_size", 7168},
      {"num_hidden_layers", layers},
      {"rms_norm_eps", 1e-5},
      {"max_position_embeddings", 1048576},
      {"hidden_act", "situ"},
      {"activation_situ_beta", 4.0},
      {"activation_situ_linear_beta", 25.0},
      {"intermediate_size", 33792},
      {"first_k_dense_replace", 1},
      {"moe_layer_freq", 1},
      {"num_attention_heads", 96},
      {"num_key_value_heads", 96},
      {"q_lora_rank", 1536},
      {"kv_lora_rank", 512},
      {"qk_nope_head_dim", 128},
      {"qk_rope_head_dim", 64},
      {"v_head_dim", 128},
      {"mla_use_nope", true},
      {"mla_use_output_gate", true},
      {"num_experts", 896},
      {"num_experts_per_token", 16},
      {"num_shared_experts", 2},
      {"moe_intermediate_size", 3072},
      {"routed_expert_hidden_size", 3584},
      {"latent_moe_use_norm", true},
      {"moe_router_activation_func", "sigmoid"},
      {"topk_method", "noaux_tc"},
      {"use_grouped_topk", true},
      {"num_expert_group", 1},
      {"topk_group", 1},
      {"moe_renormalize", true},
      {"routed_scaling_factor", 1.0},
      {"attn_res_block_size", 12},
      {"num_nextn_predict_layers", 0},
      {"tie_word_embeddings", false},
      {"bos_token_id", 163584},
      {"eos_token_id", 163586},
      {"linear_attn_config",
       {{"num_heads", 96},
        {"head_dim", 128},
        {"short_conv_kernel_size", 4},
        {"use_full_rank_gate", true},
        {"gate_lower_bound", -5.0},
        {"kda_layers", kda},
        {"full_attn_layers", full}}},
  };
  return Json{{"model_type", "kimi_k3"},
              {"architectures", {"KimiK3ForConditionalGeneration"}},
              {"pad_token_id", 163839},
              {"bos_token_id", 163584},
              {"eos_token_id", 163586},
              {"tie_word_embeddings", false},
              {"text_config", text}};
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"gpt2", "GPT-2 124M (HF gpt2 shape)", [] { return gpt2_config(50257, 1024, 768, 12, 12); }, std::nullopt},
      {"gpt2-tiny", "GPT-2, 2 layers of width 128 (about 1M parameters with a 1K vocabulary)",
       [] { return gpt2_config(1024, 256, 128, 2, 4); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"gpt2-small", "GPT-2, 6 layers of width 384 (about 15M parameters with an 8K vocabulary)",
       [] { return gpt2_config(8192, 512, 384, 6, 6); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"kimi-k3", "Kimi K3 as published: 93 layers (69 KDA + 24 gated MLA), 896 experts",
       [] { return kimi_k3_config(93); }, std::nullopt},
      {"kimi-k3-seed", "Kimi K3 as the article describes it: 92 layers, 23 x (3 KDA + 1 MLA)",
       [] { return kimi_k3_config(92); }, std::nullopt},
  };
  return p;
}

}  // namespace k3
