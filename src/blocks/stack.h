// A stack of pre-norm blocks: what every decoder shares — running the layers over B sequences
// (each continuing its own Context when given) under the residual rule the config names (plain
// additions, or Kimi K3's block Attention Residuals), the per-layer memory report, new contexts,
// and the MoE bookkeeping after an optimizer step.
#pragma once

#include <optional>
#include <vector>

#include "blocks/block.h"
#include "residual/ag_attnres.h"

namespace k3 {

// One stateful layer's memory needs, for `k3 info` and the memory report.
struct LayerMemory {
  int64_t layer;
  MemorySpec spec;
};

// Block Attention Residuals (spec §10.3): before the mixer and before the FFN of every layer, and
// once after the last layer, the residual stream is a learned softmax mix of the completed blocks'
// sums and the running partial sum; a new block starts every `block_size` layers. `names` are the
// mixes' parameter names (projection, norm) within a layer and within the model.
struct AttnResidual {
  int64_t block_size = 1;
  int64_t D = 0;
  float eps = 1e-6f;
  struct Names {
    std::string mixer_proj, mixer_norm, ffn_proj, ffn_norm, output_proj, output_norm;
  } names;
};

class BlockStack {
 public:
  BlockStack() = default;  // plain residual additions
  explicit BlockStack(AttnResidual rule);
  void add(PreNormBlock block);
  size_t size() const { return blocks_.size(); }
  const PreNormBlock& operator[](size_t l) const { return blocks_[l]; }

  // The batch view of layer l: B sequences of T tokens and, with contexts, their layer-l memories.
  struct LayerBatches {
    LayerBatches(int64_t B, int64_t T, Context* const* contexts) : B_(B), T_(T), contexts_(contexts), mems_(static_cast<size_t>(B)) {}
    SeqBatch operator()(size_t l);

   private:
    int64_t B_, T_;
    Context* const* contexts_;
    std::vector<Memory*> mems_;
  };

  // Every layer under the stack's residual rule (with Attention Residuals, the output mix too).
  // Advances the contexts' positions.
  Var forward(Var x, int64_t B, int64_t T, Context* const* contexts) const;
  // Layer l's parameters under `prefix` (its block's, then its residual mixes'), and the
  // stack-level ones (the output mix) under `model_prefix`.
  void visit_layer(size_t l, const std::string& prefix, const ParamVisitor& v) const;
  void visit_stack(const std::string& model_prefix, const ParamVisitor& v) const;
  std::vector<LayerMemory> memory_layers() const;
  Context new_context(int64_t max_tokens) const;
  // Parameters of routed experts not used per token (total − active over MoE layers).
  int64_t idle_expert_params() const;
  // The same expected for a step of `tokens` tokens under uniform routing (Model::idle_expert_params).
  double idle_expert_params(int64_t tokens) const;
  // Moves every MoE router's selection bias toward balanced load (DeepSeek-V3's
  // auxiliary-loss-free balancing).
  void balance_experts(float gamma) const;
  // Sum of the MoE layers' sequence-level balance losses of the last forward (null if none).
  Var balance_loss(int64_t seq_len, float alpha) const;

 private:
  Var forward_attn_res(Var x, int64_t B, int64_t T, Context* const* contexts) const;

  std::vector<PreNormBlock> blocks_;
  std::optional<AttnResidual> attn_res_;
  std::vector<AttnResMix> mixer_res_, ffn_res_;  // with attn_res_: one pair per layer
  AttnResMix output_res_;
};

void advance_positions(Context* const* contexts, int64_t B, int64_t T);

}  // namespace k3
