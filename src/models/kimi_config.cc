#include "models/kimi_config.h"

#include <algorithm>

namespace k3 {

bool KimiConfig::is_kda_layer(int64_t l) const {
  const auto& k = linear_attn_config.kda_layers;
  return std::find(k.begin(), k.end(), l + 1) != k.end();
}

bool KimiConfig::is_moe_layer(int64_t l) const {
  return num_experts.has_value() && l >= first_k_dense_replace && l % moe_layer_freq == 0;
}

KimiConfig read_kimi_config(const Json& j, const std::string& where) {
  const Json* text = &j;
  std::string w = where;
  if (j.is_object() && j.value("model_type", "") == "kimi_k3") {
    if (!j.contains("text_config") || !j["text_config"].is_object())
      throw error("config", where, ": model_type kimi_k3 needs a 'text_config' object");
    text = &j["text_config"];
    w += " (text_config)";
  }
  KimiConfig c = read_config<KimiConfig>(*text, w);
  if (!text->contains("linear_attn_config") || !(*text)["linear_attn_config"].is_object())
    throw error("config", w, ": missing 'linear_attn_config' object");
  c.linear_attn_config = read_config<KimiLinearAttnConfig>((*text)["linear_attn_config"], w + ".linear_attn_config");
  const auto& la = c.linear_attn_config;
  for (int64_t l = 1; l <= c.num_hidden_layers; ++l) {
    bool kda = std::count(la.kda_layers.begin(), la.kda_layers.end(), l) != 0;
    bool full = std::count(la.full_attn_layers.begin(), la.full_attn_layers.end(), l) != 0;
    if (kda == full)
      throw error("config", w, ": layer ", l, " (1-based) must be in exactly one of kda_layers and full_attn_layers");
  }
  for (int64_t l : la.kda_layers)
    if (l > c.num_hidden_layers) throw error("config", w, ": kda_layers names layer ", l, " past num_hidden_layers");
  for (int64_t l : la.full_attn_layers)
    if (l > c.num_hidden_layers) throw error("config", w, ": full_attn_layers names layer ", l, " past num_hidden_layers");
  if (c.hidden_act == "situ" && !c.activation_situ_beta)
    throw error("config", w, ": hidden_act situ needs activation_situ_beta");
  return c;
}

}  // namespace k3
