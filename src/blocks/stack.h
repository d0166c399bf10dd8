// A stack of pre-norm blocks: what every decoder shares — running the layers over B sequences
// (each continuing its own Context when given), the per-layer memory report, new contexts, and
// the MoE bookkeeping after an optimizer step.
#pragma once

#include <vector>

#include "blocks/block.h"

namespace k3 {

// One stateful layer's memory needs, for `k3 info` and the memory report.
struct LayerMemory {
  int64_t layer;
  MemorySpec spec;
};

class BlockStack {
 public:
  void add(PreNormBlock block) { blocks_.push_back(std::move(block)); }
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

  // Plain residual stack: x = block_l(x) for every layer. Advances the contexts' positions.
  Var forward(Var x, int64_t B, int64_t T, Context* const* contexts) const;
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
  std::vector<PreNormBlock> blocks_;
};

void advance_positions(Context* const* contexts, int64_t B, int64_t T);

}  // namespace k3
