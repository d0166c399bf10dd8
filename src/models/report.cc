#include "models/report.h"

#include "models/kimi_config.h"

namespace k3 {

double ArchReport::sequence_bytes(int64_t context) const {
  double b = 0;
  for (const auto& lm : memory) b += lm.spec.fixed_bytes + lm.spec.per_token_bytes * double(context);
  return b;
}

ArchReport report_from_model(const Model& m, const std::string& name) {
  ArchReport r;
  r.name = name;
  r.architecture = m.architecture();
  r.layers = m.num_layers();
  r.max_positions = m.max_positions();
  r.total_params = m.total_params();
  r.active_params = m.active_params();
  r.weights.push_back({"fp32", double(r.total_params) * 4});
  r.weights.push_back({"bf16", double(r.total_params) * 2});
  r.memory = m.memory_layers();
  return r;
}

namespace {
// Parameter counts of the Kimi components from their HF shapes.
struct KimiCounts {
  int64_t kda = 0, mla = 0, dense_ffn = 0, moe_total = 0, expert = 0, layer_norms = 0;
};

KimiCounts count_kimi(const KimiConfig& c) {
  const int64_t d = c.hidden_size;
  const auto& la = c.linear_attn_config;
  const int64_t H = la.num_heads, dk = la.head_dim, dv = la.head_dim, kc = la.short_conv_kernel_size;
  KimiCounts k;
  // KDA (spec §5.3; K3 full-rank output gate §11)
  k.kda = 3 * d * H * dk            // q, k, v proj
          + d * dk + dk * H * dk    // f_a, f_b (decay, low-rank)
          + d * H                   // b_proj
          + H * dv * d              // o_proj
          + (2 * H * dk + H * dv) * kc  // q/k/v short convs
          + H + H * dk              // A_log, dt_bias
          + dv;                     // o_norm
  k.kda += la.use_full_rank_gate ? d * H * dv : d * dv + dv * H * dv;  // g_proj or g_a/g_b
  // MLA (spec §6-§7)
  const int64_t nh = c.num_attention_heads, qd = c.qk_nope_head_dim + c.qk_rope_head_dim;
  k.mla = c.q_lora_rank ? d * *c.q_lora_rank + *c.q_lora_rank + *c.q_lora_rank * nh * qd : d * nh * qd;
  k.mla += d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank      // kv_a + its norm
           + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)     // kv_b
           + nh * c.v_head_dim * d;                                         // o_proj
  if (c.mla_use_output_gate) k.mla += d * nh * c.v_head_dim;               // g_proj
  // FFNs (GLU: gate, up, down)
  k.dense_ffn = 3 * d * c.intermediate_size;
  const int64_t E = c.num_experts.value_or(0);
  const int64_t lat = c.routed_expert_hidden_size.value_or(d);
  k.expert = 3 * lat * c.moe_intermediate_size;
  k.moe_total = E * k.expert + E * d + E                      // experts, router, correction bias
                + 3 * d * c.num_shared_experts * c.moe_intermediate_size;
  if (c.routed_expert_hidden_size) k.moe_total += 2 * d * lat + (c.latent_moe_use_norm ? lat : 0);
  k.layer_norms = 2 * d + (c.attn_res_block_size ? 4 * d : 0);  // norms + AttnRes proj/norm pairs
  return k;
}
}  // namespace

ArchReport report_kimi(const Json& config, const std::string& name) {
  KimiConfig c = read_kimi_config(config, name);
  KimiCounts k = count_kimi(c);
  const int64_t d = c.hidden_size, V = c.vocab_size;
  const auto& la = c.linear_attn_config;
  ArchReport r;
  r.name = name;
  r.architecture = config.value("model_type", c.model_type);
  r.layers = c.num_hidden_layers;
  r.max_positions = 0;
  int64_t total = 0, experts_idle = 0, expert_params = 0, nkda = 0, nmla = 0, nmoe = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_kda_layer(l)) {
      total += k.kda;
      ++nkda;
      // Recurrent state S [H, dk, dv] fp32 + conv tails [(2 H dk + H dv), kc - 1] fp32.
      r.memory.push_back({l, {MemoryKind::RecurrentState, 0, double(la.num_heads * la.head_dim * la.head_dim) * 4}});
      r.memory.push_back({l, {MemoryKind::ConvTail, 0, double(3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1)) * 4}});
    } else {
      total += k.mla;
      ++nmla;
      // Latent cache: c_kv + k_rope per token, bf16 as served (spec §6, §11).
      r.memory.push_back({l, {MemoryKind::LatentCache, double(c.kv_lora_rank + c.qk_rope_head_dim) * 2, 0}});
    }
    if (c.is_moe_layer(l)) {
      total += k.moe_total;
      ++nmoe;
      experts_idle += (*c.num_experts - c.num_experts_per_token) * k.expert;
      expert_params += *c.num_experts * k.expert;
    } else {
      total += k.dense_ffn;
    }
    total += k.layer_norms;
  }
  const int64_t embed = V * d, head = c.tie_word_embeddings ? 0 : V * d;
  total += embed + head + d + (c.attn_res_block_size ? 2 * d : 0);  // final norm, output AttnRes
  r.total_params = total;
  r.active_params = total - embed - experts_idle;
  r.weights.push_back({"bf16", double(total) * 2});
  if (expert_params > 0)  // MXFP4: 4 bits per value + one E8M0 scale byte per 32 values
    r.weights.push_back({"bf16 + MXFP4 routed experts", double(total - expert_params) * 2 + double(expert_params) * (0.5 + 1.0 / 32)});
  r.notes.push_back(std::to_string(nkda) + " KDA + " + std::to_string(nmla) + " MLA layers, " + std::to_string(nmoe) +
                    " MoE layers (" + std::to_string(c.num_experts.value_or(0)) + " routed experts, top-" +
                    std::to_string(c.num_experts_per_token) + ", " + std::to_string(c.num_shared_experts) + " shared)");
  return r;
}

}  // namespace k3
