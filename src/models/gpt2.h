// GPT-2 (spec §1): learned positions, pre-LN blocks of softmax attention + GELU MLP, tied
// LM head. Loads HF checkpoints (Conv1D [in, out] weights, with or without "transformer.").
#pragma once

#include <memory>
#include <vector>

#include "blocks/block.h"
#include "models/model.h"

namespace k3 {

struct Gpt2Config {
  std::string model_type = "gpt2";
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  std::optional<int64_t> n_inner;  // null: 4 * n_embd
  double layer_norm_epsilon = 1e-5;
  std::string activation_function = "gelu_new";
  bool tie_word_embeddings = true;
  bool scale_attn_weights = true;
  bool scale_attn_by_inverse_layer_idx = false;
  std::optional<int64_t> bos_token_id = 50256;
  std::optional<int64_t> eos_token_id = 50256;
  // k3 extension (absent from HF GPT-2): a causal depthwise short convolution of this width over
  // q | k | v after c_attn, then SiLU, as the delta-rule family has (the recall suite's
  // controlled softmax baseline). Unset or 0: plain GPT-2.
  std::optional<int64_t> k3_short_conv;

  template <class V>
  void fields(V& v) {
    v("model_type", model_type).one_of({"gpt2"});
    v("vocab_size", vocab_size, Presence::Required).positive().at_most(1 << 24);
    v("n_positions", n_positions, Presence::Required).positive().at_most(1 << 24);
    v("n_embd", n_embd, Presence::Required).positive().at_most(1 << 16);
    v("n_layer", n_layer, Presence::Required).positive().at_most(4096);
    v("n_head", n_head, Presence::Required).positive().at_most(1 << 12);
    v("n_inner", n_inner).positive().at_most(1 << 20);
    v("layer_norm_epsilon", layer_norm_epsilon).positive();
    v("activation_function", activation_function).one_of({"gelu_new", "gelu_pytorch_tanh"});
    v("tie_word_embeddings", tie_word_embeddings);
    v("scale_attn_weights", scale_attn_weights);
    v("scale_attn_by_inverse_layer_idx", scale_attn_by_inverse_layer_idx);
    v("bos_token_id", bos_token_id).token_id(vocab_size);
    v("eos_token_id", eos_token_id).token_id(vocab_size);
    v("k3_short_conv", k3_short_conv).non_negative().at_most(64);
  }
  void validate(const std::string& where) const;
};

class Gpt2Model final : public Model {
 public:
  explicit Gpt2Model(const Gpt2Config& c);
  static std::unique_ptr<Model> from_config(const Json& j, const std::string& where);
  static std::unique_ptr<Model> load(const std::string& dir, const Json& j, const LoadPlan& plan);

  std::string architecture() const override { return "gpt2"; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.n_positions; }
  int64_t num_layers() const override { return c_.n_layer; }
  void visit(const ParamVisitor& v) const override;
  Json config_json() const override;
  std::vector<LayerMemory> memory_layers() const override;
  Context new_context(int64_t max_tokens) const override;
  Var hidden(const TokenBatch& batch) const override;
  Var head_weight() const override { return wte_; }  // tied
  void init_random(uint64_t seed) override;
  // Everything but the position table: wte is read in full by the tied LM head.
  int64_t active_params() const override { return total_params() - wpe_->value.numel(); }

  std::string checkpoint_name(const std::string& name) const override { return "transformer." + name; }
  const Gpt2Config& config() const { return c_; }

 private:
  Gpt2Config c_;
  Var wte_, wpe_;  // [V, D], [P, D]
  BlockStack blocks_;
  Norm ln_f_;
};

}  // namespace k3
