// Pre-norm block: x = x + mixer(norm1(x)); x = x + ffn(norm2(x)) (plain residual rule; the
// AttnRes rule of Kimi K3 replaces the two additions). Module names come from the model
// (GPT-2: ln_1 / attn / ln_2 / mlp; Kimi: input_layernorm / self_attn /
// post_attention_layernorm / mlp or block_sparse_moe).
#pragma once

#include <memory>

#include "ffn/ffn.h"
#include "mixers/mixer.h"
#include "ops/linear.h"

namespace k3 {

struct BlockNames {
  std::string norm1, mixer, norm2, ffn;
};

class PreNormBlock {
 public:
  PreNormBlock(Norm norm1, std::unique_ptr<Mixer> mixer, Norm norm2, std::unique_ptr<Ffn> ffn, BlockNames names);
  Var forward(const Var& x, const SeqBatch& batch) const;  // x [B*T, D]
  void visit(const std::string& prefix, const ParamVisitor& v) const;
  const Mixer& mixer() const { return *mixer_; }
  const Ffn& ffn() const { return *ffn_; }
  // The pieces, for residual rules other than the plain sum (AttnRes).
  Var mix(const Var& x, const SeqBatch& batch) const;  // mixer(norm1(x))
  Var feed(const Var& x) const;                        // ffn(norm2(x))

 private:
  Norm norm1_;
  std::unique_ptr<Mixer> mixer_;
  Norm norm2_;
  std::unique_ptr<Ffn> ffn_;
  BlockNames names_;
};

}  // namespace k3
