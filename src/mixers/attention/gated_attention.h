// Qwen3-Next's gated softmax attention (transformers' Qwen3NextAttention): grouped-query heads
// (kv_heads ≤ heads), q_proj emitting each head's query and output gate side by side, RMSNorm of
// q and k over each head (zero-centred weights), RoPE on the first rope_dim columns of each head
// with rotate-half pairs, softmax(q kᵀ / sqrt(hd)) v, the output times sigmoid(gate), o_proj.
// Memory: a KV cache holding every query head's keys and values (the grouped heads repeated).
#pragma once

#include "mixers/attention/kv_cache.h"
#include "mixers/mixer.h"
#include "ops/linear.h"
#include "ops/rope.h"

namespace k3 {

struct GatedAttentionOptions {
  int64_t d_model = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t rope_dim = 0;  // rotated columns per head (head_dim · partial_rotary_factor)
  double rope_theta = 10000.0;
  int64_t max_positions = 0;
  float eps = 1e-6f;  // of q_norm and k_norm
};

class GatedAttention final : public Mixer {
 public:
  explicit GatedAttention(const GatedAttentionOptions& o);
  Var forward(const Var& x, const SeqBatch& batch) const override;
  std::unique_ptr<Memory> new_memory(int64_t max_tokens) const override;
  std::vector<MemorySpec> memory_spec() const override;
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  std::string_view name() const override { return "gated_attention"; }

 private:
  Var per_head_norm(const Norm& n, const Var& x, int64_t heads) const;
  Var repeat_kv(const Var& x) const;  // [M, kv_heads·hd] -> [M, heads·hd], head h reading kv head h / group

  GatedAttentionOptions o_;
  Linear q_proj_, k_proj_, v_proj_, o_proj_;
  Norm q_norm_, k_norm_;
  RopeTable rope_;
};

}  // namespace k3
