// Kimi Linear and Kimi K3 (spec §5, §6-§11): hybrid stacks of KDA and MLA layers (1-based
// kda_layers / full_attn_layers), first_k_dense_replace dense GLU layers then MoE.
//   kimi_linear: NoPE MLA, low-rank KDA output gate, softplus decay, SiLU MoE, plain residuals.
//   kimi_k3:     gated MLA, full-rank KDA output gate, lower-bound decay, latent MoE with SiTU,
//                block Attention Residuals; HF names under "language_model." and config in
//                "text_config".
#pragma once

#include "blocks/block.h"
#include "models/kimi_config.h"
#include "models/model.h"
#include "residual/ag_attnres.h"

namespace k3 {

enum class KimiFlavor : uint8_t { Linear, K3 };

class KimiModel final : public Model {
 public:
  KimiModel(const KimiConfig& c, KimiFlavor f, const Json& raw, int64_t a_log_size);
  static std::unique_ptr<Model> linear_from_config(const Json& j, const std::string& where);
  static std::unique_ptr<Model> k3_from_config(const Json& j, const std::string& where);
  static std::unique_ptr<Model> load(const std::string& dir, const Json& j, const LoadPlan& plan);

  std::string architecture() const override { return flavor_ == KimiFlavor::K3 ? "kimi_k3" : "kimi_linear"; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.max_position_embeddings; }
  int64_t num_layers() const override { return c_.num_hidden_layers; }
  void visit(const ParamVisitor& v) const override;
  Json config_json() const override { return raw_; }
  std::vector<LayerMemory> memory_layers() const override;
  Context new_context(int64_t max_tokens) const override;
  Var hidden(const TokenBatch& batch) const override;
  Var head_weight() const override { return lm_head_; }
  void init_random(uint64_t seed) override;
  int64_t active_params() const override;
  double idle_expert_params(int64_t tokens) const override { return blocks_.idle_expert_params(tokens); }
  void after_step() const override;
  Var aux_loss(int64_t seq_len, float alpha) const override { return blocks_.balance_loss(seq_len, alpha); }

 private:
  std::string prefix() const { return flavor_ == KimiFlavor::K3 ? "language_model." : ""; }
  KimiConfig c_;
  KimiFlavor flavor_;
  Json raw_;
  Var embed_, lm_head_;
  BlockStack blocks_;
  Norm norm_;
};

}  // namespace k3
