// flash-linear-attention's language models (fla/models/*): LinearAttention ("linear_attn"),
// DeltaNet ("delta_net"), Gated DeltaNet ("gated_deltanet") and KDA ("kda") decoders with fla's
// names, so fla-trained checkpoints load: model.embeddings, model.layers.{i}.{attn_norm, attn,
// mlp_norm, mlp.{gate,up,down}_proj}, model.norm, lm_head. RMSNorm pre-norm blocks, SwiGLU MLPs.
#pragma once

#include "blocks/block.h"
#include "mixers/linear/delta_layer.h"
#include "models/model.h"

namespace k3 {

struct FlaConfig {
  std::string model_type;
  int64_t vocab_size = 32000, hidden_size = 2048, num_hidden_layers = 24, num_heads = 16;
  std::optional<int64_t> head_dim, num_v_heads, intermediate_size;
  double expand_k = 1.0, expand_v = 1.0, hidden_ratio = 4.0;
  int64_t conv_size = 4;
  bool use_short_conv = true, tie_word_embeddings = false;
  std::optional<bool> use_gate;  // output gate; fla's default: off for delta_net, on for gated_deltanet
  std::string feature_map = "elu";
  std::optional<double> lower_bound;
  double norm_eps = 1e-6;
  int64_t max_position_embeddings = 1 << 20;
  std::optional<int64_t> bos_token_id, eos_token_id;

  template <class V>
  void fields(V& v) {
    v("model_type", model_type).one_of({"linear_attn", "delta_net", "gated_deltanet", "kda"});
    v("vocab_size", vocab_size, Presence::Required).positive().at_most(1 << 24);
    v("hidden_size", hidden_size, Presence::Required).positive().at_most(1 << 16);
    v("num_hidden_layers", num_hidden_layers, Presence::Required).positive().at_most(4096);
    v("num_heads", num_heads, Presence::Required).positive().at_most(4096);
    v("head_dim", head_dim).positive().at_most(4096);
    v("num_v_heads", num_v_heads).positive().at_most(4096);
    v("intermediate_size", intermediate_size).positive().at_most(1 << 20);
    v("expand_k", expand_k).positive();
    v("expand_v", expand_v).positive();
    v("hidden_ratio", hidden_ratio).positive();
    v("conv_size", conv_size).positive().at_most(64);
    v("use_short_conv", use_short_conv);
    v("use_gate", use_gate);
    v("tie_word_embeddings", tie_word_embeddings);
    v("feature_map", feature_map).one_of({"elu"});
    v("lower_bound", lower_bound);
    v("norm_eps", norm_eps).positive();
    v("max_position_embeddings", max_position_embeddings).positive();
    v("bos_token_id", bos_token_id).token_id(vocab_size);
    v("eos_token_id", eos_token_id).token_id(vocab_size);
  }
};

class FlaModel final : public Model {
 public:
  FlaModel(const FlaConfig& c, const Json& raw);
  static std::unique_ptr<Model> from_config(const Json& j, const std::string& where);
  static std::unique_ptr<Model> load(const std::string& dir, const Json& j, const LoadPlan& plan);

  std::string architecture() const override { return c_.model_type; }
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

 private:
  FlaConfig c_;
  Json raw_;
  Var embed_, lm_head_;
  BlockStack blocks_;
  Norm norm_;
};

DeltaLayerOptions fla_layer_options(const FlaConfig& c);

}  // namespace k3
