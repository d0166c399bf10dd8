// GPT-2 causal self-attention (spec §1): fused c_attn (D -> 3D, split q | k | v), heads of
// D/H, softmax(q kᵀ / sqrt(hd)) v, c_proj. Memory: a KV cache.
// Optional (conv_size > 0, a k3 extension): a causal depthwise short convolution over q | k | v
// after c_attn, then SiLU, as in the delta-rule layers; the KV cache then also keeps the conv
// tail (CPU memories only).
#pragma once

#include "mixers/attention/kv_cache.h"
#include "mixers/mixer.h"
#include "ops/linear.h"

namespace k3 {

struct SoftmaxAttentionOptions {
  int64_t d_model;
  int64_t heads;
  int64_t max_positions;
  WeightLayout layout;  // GPT-2 Conv1D stores [in, out]
  int64_t conv_size = 0;  // 0: none
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
  Var c_attn_conv;  // [3D, 1, conv_size] when conv_size > 0

 private:
  SoftmaxAttentionOptions o_;
  int64_t hd_;
  Var conv(const Var& qkv, const SeqBatch& batch) const;
};

}  // namespace k3
