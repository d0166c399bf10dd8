#include "blocks/block.h"

namespace k3 {

PreNormBlock::PreNormBlock(Norm norm1, std::unique_ptr<Mixer> mixer, Norm norm2, std::unique_ptr<Ffn> ffn,
                           BlockNames names)
    : norm1_(std::move(norm1)), mixer_(std::move(mixer)), norm2_(std::move(norm2)), ffn_(std::move(ffn)),
      names_(std::move(names)) {}

Var PreNormBlock::forward(const Var& x, const SeqBatch& batch) const {
  Var h = ag::add(x, mix(x, batch));
  return ag::add(h, feed(h));
}

void PreNormBlock::visit(const std::string& prefix, const ParamVisitor& v) const {
  norm1_.visit(join_name(prefix, names_.norm1), v);
  mixer_->visit(join_name(prefix, names_.mixer), v);
  norm2_.visit(join_name(prefix, names_.norm2), v);
  ffn_->visit(join_name(prefix, names_.ffn), v);
}

}  // namespace k3
