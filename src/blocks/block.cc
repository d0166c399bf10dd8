#include "blocks/block.h"

#include <string>

#include "core/profile.h"

namespace k3 {

PreNormBlock::PreNormBlock(Norm norm1, std::unique_ptr<Mixer> mixer, Norm norm2, std::unique_ptr<Ffn> ffn,
                           BlockNames names)
    : norm1_(std::move(norm1)), mixer_(std::move(mixer)), norm2_(std::move(norm2)), ffn_(std::move(ffn)),
      names_(std::move(names)) {}

Var PreNormBlock::mix(const Var& x, const SeqBatch& batch) const {
  profile::Scope s(profile::enabled() ? "mixer " + std::string(mixer_->name()) : std::string());
  return mixer_->forward(norm1_(x), batch);
}

Var PreNormBlock::feed(const Var& x) const {
  profile::Scope s("ffn");
  return ffn_->forward(norm2_(x));
}

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
