// Multi-token prediction (DeepSeek-V3 §2.2, `num_nextn_predict_layers`): one more decoder block
// beside the model's layers. Row i reads the model's final (normalised) hidden state at position i
// and the embedding of token i+1, and predicts token i+2:
//   x = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])]),  o = block(x),  logits = head(norm(o)).
// Fed its own output o in place of h, it drafts further tokens. Its attention keeps a memory of its
// own (a Context over rows 0, 1, ... at positions 0, 1, ...). HF names under model.layers.{L}
// (L = num_hidden_layers): enorm, hnorm, eh_proj, shared_head.{norm, head}, and the block's
// input_layernorm, self_attn, post_attention_layernorm, mlp. The checkpoint's copy of the
// embedding (embed_tokens there) equals the model's, which is the one used.
#pragma once

#include <vector>

#include "blocks/stack.h"
#include "ops/linear.h"

namespace k3 {

class MtpHead {
 public:
  MtpHead(PreNormBlock block, int64_t d_model, int64_t vocab, float eps, Var embed);
  void visit(const std::string& prefix, const ParamVisitor& v) const;
  Context new_context(int64_t max_tokens) const;
  // Output o [T, D] of T rows continuing ctx: prev [T, D] (the model's hidden states, or this
  // head's own output for drafts past the first), next_ids the tokens one position later.
  Var forward(const Var& prev, const std::vector<int64_t>& next_ids, Context* ctx) const;
  // The greedy pick of o's last row.
  int64_t pick(const Var& o) const;
  const Var& head() const { return head_; }
  const Norm& norm() const { return norm_; }

 private:
  int64_t d_;
  Var embed_, eh_proj_, head_;
  Norm enorm_, hnorm_, norm_;
  BlockStack block_;
};

}  // namespace k3
