// GPT-2 causal self-attention (spec §1): fused c_attn (D -> 3D, split q | k | v), heads of
// D/H, softmax(q kᵀ / sqrt(hd)) v, c_proj. Memory: a KV cache.
#pragma once

#include "mixers/kv_cache.h"
#include "mixers/mixer.h"
#include "ops/linear.h"

namespace k3 {

struct SoftmaxAttentionOptions {
  int64_t d_model;
  int64_t heads;
  int64_t max_positions;
  WeightLayout layout;  // GPT-2 Conv1D stores [in, out]
};

class SoftmaxAttention final : public Mixer {
 public:
  explicit SoftmaxAttention(const SoftmaxAttentionOptions& o);
  Var forward(const Var& x, const SeqBatch& batch) const override;
  std::unique_ptr<Memory> new_memory(int64_t max_tokens) const override;
  std::vector<MemorySpec> memory_spec() const override;
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  std::string_view name() const override { return "softmax"; }

  Linear c_attn, c_proj;

 private:
  SoftmaxAttentionOptions o_;
  int64_t hd_;
};

}  // namespace k3
