#include "models/presets.h"

#include <algorithm>

namespace k3 {

namespace {

Json gpt2_config(int64_t vocab, int64_t positions, int64_t d, int64_t layers, int64_t heads) {
  return Json{{"model_type", "gpt2"},   {"architectures", {"GPT2LMHeadModel"}},
              {"vocab_size", vocab},    {"n_positions", positions},
              {"n_embd", d},            {"n_layer", layers},
              {"n_head", heads},        {"n_inner", nullptr},
              {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"},
              {"tie_word_embeddings", true}, {"bos_token_id", std::min<int64_t>(50256, vocab - 1)},
              {"eos_token_id", std::min<int64_t>(50256, vocab - 1)}};  // <|endoftext|>, the last id
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

// Kimi-Linear-48B-A3B as published (moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json): 27
// layers, 20 KDA + 7 NoPE MLA, 256 experts top-8 + 1 shared. The file gives its context as
// model_max_length (1,048,576) and has no max_position_embeddings: that length is used.
Json kimi_linear_48b_config() {
  std::vector<int64_t> full = {4, 8, 12, 16, 20, 24, 27}, kda;
  for (int64_t l = 1; l <= 27; ++l)
    if (std::find(full.begin(), full.end(), l) == full.end()) kda.push_back(l);
  return Json{{"model_type", "kimi_linear"},
              {"architectures", {"KimiLinearForCausalLM"}},
              {"vocab_size", 163840},
              {"hidden_size", 2304},
              {"intermediate_size", 9216},
              {"moe_intermediate_size", 1024},
              {"num_hidden_layers", 27},
              {"num_attention_heads", 32},
              {"num_key_value_heads", 32},
              {"head_dim", 72},
              {"q_lora_rank", nullptr},
              {"kv_lora_rank", 512},
              {"qk_nope_head_dim", 128},
              {"qk_rope_head_dim", 64},
              {"v_head_dim", 128},
              {"mla_use_nope", true},
              {"num_experts", 256},
              {"num_experts_per_token", 8},
              {"num_shared_experts", 1},
              {"first_k_dense_replace", 1},
              {"moe_layer_freq", 1},
              {"routed_scaling_factor", 2.446},
              {"moe_router_activation_func", "sigmoid"},
              {"moe_renormalize", true},
              {"use_grouped_topk", true},
              {"num_expert_group", 1},
              {"topk_group", 1},
              {"num_nextn_predict_layers", 0},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 10000.0},
              {"max_position_embeddings", 1048576},
              {"tie_word_embeddings", false},
              {"bos_token_id", 163584},
              {"eos_token_id", 163586},
              {"pad_token_id", 163839},
              {"hidden_act", "silu"},
              {"linear_attn_config",
               {{"num_heads", 32}, {"head_dim", 128}, {"short_conv_kernel_size", 4}, {"kda_layers", kda},
                {"full_attn_layers", full}}}};
}

// Qwen3-Next-80B-A3B as published (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json): 48 layers,
// every fourth gated attention, the others Gated DeltaNet; 512 experts top-10 + a gated shared one.
Json qwen3_next_80b_config() {
  return Json{{"model_type", "qwen3_next"},
              {"architectures", {"Qwen3NextForCausalLM"}},
              {"vocab_size", 151936},
              {"hidden_size", 2048},
              {"intermediate_size", 5120},
              {"moe_intermediate_size", 512},
              {"shared_expert_intermediate_size", 512},
              {"num_hidden_layers", 48},
              {"num_attention_heads", 16},
              {"num_key_value_heads", 2},
              {"head_dim", 256},
              {"linear_num_key_heads", 16},
              {"linear_num_value_heads", 32},
              {"linear_key_head_dim", 128},
              {"linear_value_head_dim", 128},
              {"linear_conv_kernel_dim", 4},
              {"num_experts", 512},
              {"num_experts_per_tok", 10},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", Json::array()},
              {"full_attention_interval", 4},
              {"norm_topk_prob", true},
              {"partial_rotary_factor", 0.25},
              {"rope_theta", 10000000.0},
              {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 262144},
              {"tie_word_embeddings", false},
              {"bos_token_id", 151643},
              {"eos_token_id", 151645},
              {"hidden_act", "silu"}};
}

// DeepSeek-V3 (671B) as published (deepseek-ai/DeepSeek-V3's config.json), YaRN to 163,840
// positions; its weights ship as block-scaled FP8.
Json deepseek_v3_config() {
  return Json{{"model_type", "deepseek_v3"},
              {"architectures", {"DeepseekV3ForCausalLM"}},
              {"vocab_size", 129280},
              {"hidden_size", 7168},
              {"intermediate_size", 18432},
              {"moe_intermediate_size", 2048},
              {"num_hidden_layers", 61},
              {"num_attention_heads", 128},
              {"num_key_value_heads", 128},
              {"q_lora_rank", 1536},
              {"kv_lora_rank", 512},
              {"qk_nope_head_dim", 128},
              {"qk_rope_head_dim", 64},
              {"v_head_dim", 128},
              {"n_routed_experts", 256},
              {"n_shared_experts", 1},
              {"num_experts_per_tok", 8},
              {"n_group", 8},
              {"topk_group", 4},
              {"first_k_dense_replace", 3},
              {"num_nextn_predict_layers", 1},
              {"routed_scaling_factor", 2.5},
              {"norm_topk_prob", true},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 10000.0},
              {"max_position_embeddings", 163840},
              {"rope_scaling",
               {{"type", "yarn"},
                {"factor", 40.0},
                {"original_max_position_embeddings", 4096},
                {"beta_fast", 32},
                {"beta_slow", 1},
                {"mscale", 1.0},
                {"mscale_all_dim", 1.0}}},
              {"tie_word_embeddings", false},
              {"bos_token_id", 0},
              {"eos_token_id", 1},
              {"hidden_act", "silu"}};
}

// flash-linear-attention-style models of the family (fla.h): one mixer kind, SwiGLU MLPs.
Json fla_config(const char* type, int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t inter) {
  Json j = {{"model_type", type},   {"vocab_size", vocab},       {"hidden_size", d},
            {"num_hidden_layers", layers}, {"num_heads", heads}, {"head_dim", d / heads},
            {"intermediate_size", inter},  {"conv_size", 4},     {"use_short_conv", true},
            {"norm_eps", 1e-6},            {"tie_word_embeddings", false}};
  if (std::string(type) == "linear_attn") j["feature_map"] = "elu";
  if (std::string(type) == "kda") j["lower_bound"] = -5.0;
  return j;
}

// Kimi Linear / Kimi K3 in miniature: `layers` layers of 3 KDA : 1 MLA ending on MLA, layer 0
// dense, MoE after; K3 adds gated MLA, full-rank KDA gate with the -5 bound, latent MoE, SiTU
// and block AttnRes.
enum class Mixing : uint8_t { Hybrid, AllAttention };

Json kimi_small_config(bool k3, int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t experts,
                       int64_t expert_hidden, Mixing mixing = Mixing::Hybrid) {
  std::vector<int64_t> full, kda;
  for (int64_t l = 1; l <= layers; ++l)
    (mixing == Mixing::AllAttention || l % 4 == 0 || l == layers ? full : kda).push_back(l);
  const int64_t hd = d / heads;
  Json text = {{"model_type", "kimi_linear"},
               {"architectures", {"KimiLinearForCausalLM"}},
               {"vocab_size", vocab},
               {"hidden_size", d},
               {"num_hidden_layers", layers},
               {"max_position_embeddings", 1 << 20},
               {"rms_norm_eps", 1e-5},
               {"hidden_act", k3 ? "situ" : "silu"},
               {"intermediate_size", 3 * d},
               {"first_k_dense_replace", 1},
               {"moe_layer_freq", 1},
               {"num_attention_heads", heads},
               {"num_key_value_heads", heads},
               {"q_lora_rank", k3 ? Json(d / 2) : Json(nullptr)},
               {"kv_lora_rank", d / 4},
               {"qk_nope_head_dim", hd},
               {"qk_rope_head_dim", hd / 2},
               {"v_head_dim", hd},
               {"mla_use_nope", true},
               {"mla_use_output_gate", k3},
               {"num_experts", experts},
               {"num_experts_per_token", 2},
               {"num_shared_experts", k3 ? 2 : 1},
               {"moe_intermediate_size", expert_hidden},
               {"moe_router_activation_func", "sigmoid"},
               {"moe_renormalize", true},
               {"routed_scaling_factor", k3 ? 1.0 : 2.446},
               {"num_expert_group", 1},
               {"topk_group", 1},
               {"tie_word_embeddings", false},
               {"pad_token_id", nullptr},  // transformers' default (163839) would not fit a small vocabulary
               {"linear_attn_config",
                {{"num_heads", heads},
                 {"head_dim", hd},
                 {"short_conv_kernel_size", 4},
                 {"kda_layers", kda},
                 {"full_attn_layers", full}}}};
  if (!k3) return text;
  text["activation_situ_beta"] = 4.0;
  text["activation_situ_linear_beta"] = 25.0;
  text["routed_expert_hidden_size"] = d / 2;
  text["latent_moe_use_norm"] = true;
  text["attn_res_block_size"] = 2;
  text["linear_attn_config"]["use_full_rank_gate"] = true;
  text["linear_attn_config"]["gate_lower_bound"] = -5.0;
  return Json{{"model_type", "kimi_k3"}, {"architectures", {"KimiK3ForConditionalGeneration"}},
              {"tie_word_embeddings", false}, {"pad_token_id", nullptr}, {"text_config", text}};
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"gpt2", "GPT-2 124M (HF gpt2 shape)", [] { return gpt2_config(50257, 1024, 768, 12, 12); }, std::nullopt},
      {"gpt2-tiny", "GPT-2, 2 layers of width 128 (about 1M parameters with a 1K vocabulary)",
       [] { return gpt2_config(1024, 256, 128, 2, 4); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"gpt2-small", "GPT-2, 6 layers of width 384 (about 15M parameters with an 8K vocabulary)",
       [] { return gpt2_config(8192, 512, 384, 6, 6); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"linear-tiny", "Linear attention (elu+1, fla naming), 2 layers of width 128",
       [] { return fla_config("linear_attn", 1024, 128, 2, 4, 384); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"linear-small", "Linear attention, 6 layers of width 384",
       [] { return fla_config("linear_attn", 8192, 384, 6, 6, 1024); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"deltanet-tiny", "DeltaNet (fla naming), 2 layers of width 128",
       [] { return fla_config("delta_net", 1024, 128, 2, 4, 384); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"deltanet-small", "DeltaNet, 6 layers of width 384",
       [] { return fla_config("delta_net", 8192, 384, 6, 6, 1024); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"gdn-tiny", "Gated DeltaNet (fla naming), 2 layers of width 128",
       [] { return fla_config("gated_deltanet", 1024, 128, 2, 4, 384); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"gdn-small", "Gated DeltaNet, 6 layers of width 384",
       [] { return fla_config("gated_deltanet", 8192, 384, 6, 6, 1024); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"kda-tiny", "KDA (fla naming, -5 decay bound), 2 layers of width 128",
       [] { return fla_config("kda", 1024, 128, 2, 4, 384); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"kda-small", "KDA, 6 layers of width 384",
       [] { return fla_config("kda", 8192, 384, 6, 6, 1024); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"kimi-linear-tiny", "Kimi Linear in miniature: 4 layers (3 KDA + 1 MLA), MoE 8x top-2 + 1 shared",
       [] { return kimi_small_config(false, 1024, 128, 4, 4, 8, 64); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"kimi-linear-small", "Kimi Linear, 8 layers of width 384, MoE 16x top-2 + 1 shared",
       [] { return kimi_small_config(false, 8192, 384, 8, 6, 16, 256); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"k3-tiny", "Kimi K3 in miniature: 4 layers (3 KDA + final gated MLA), dense layer 0, latent MoE 8x top-2 + 2 shared, SiTU, AttnRes blocks of 2",
       [] { return kimi_small_config(true, 1024, 128, 4, 4, 8, 64); }, TrainDefaults{600, 16, 128, 30, 3e-3f}},
      {"k3-small", "Kimi K3, 8 layers of width 384 (6 KDA + 2 gated MLA), latent MoE 16x top-2 + 2 shared",
       [] { return kimi_small_config(true, 8192, 384, 8, 6, 16, 256); }, TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"k3-small-attn", "k3-small with every layer gated MLA: the full-attention model of the same width",
       [] { return kimi_small_config(true, 8192, 384, 8, 6, 16, 256, Mixing::AllAttention); },
       TrainDefaults{2000, 16, 256, 100, 1e-3f}},
      {"kimi-k3", "Kimi K3 as published: 93 layers (69 KDA + 24 gated MLA), 896 experts",
       [] { return kimi_k3_config(93); }, std::nullopt},
      {"kimi-k3-seed", "Kimi K3 as the article describes it: 92 layers, 23 x (3 KDA + 1 MLA)",
       [] { return kimi_k3_config(92); }, std::nullopt},
      {"kimi-linear-48b", "Kimi-Linear-48B-A3B as published: 27 layers (20 KDA + 7 MLA), 256 experts top-8 + 1 shared",
       [] { return kimi_linear_48b_config(); }, std::nullopt},
      {"qwen3-next-80b", "Qwen3-Next-80B-A3B as published: 48 layers (36 Gated DeltaNet + 12 gated attention), 512 experts top-10 + 1 shared",
       [] { return qwen3_next_80b_config(); }, std::nullopt},
      {"deepseek-v3", "DeepSeek-V3 (671B) as published: 61 MLA layers, 256 experts top-8 + 1 shared, an MTP layer",
       [] { return deepseek_v3_config(); }, std::nullopt},
  };
  return p;
}

}  // namespace k3
