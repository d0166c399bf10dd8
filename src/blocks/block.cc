#include "blocks/block.h"

namespace k3 {

PreNormBlock::PreNormBlock(Norm norm1, std::unique_ptr<Mixer> mixer, Norm norm2, std::unique_ptr<Ffn> ffn,
                           BlockNames names)
    : norm1_(std::move(norm1)), mixer_(std::move(mixer)), norm2_(std::move(norm2)), ffn_(std::move(ffn)),
      names_(std::move(names)) {}

void PreNormBlock::forward(float* x, int64_t T, Memory* memory, Arena& arena) const {
  const int64_t D = norm1_.dim;
  Tensor h = arena.alloc({T, D});    // [T, D]
  Tensor out = arena.alloc({T, D});  // [T, D]
  norm1_.forward(x, T, h.f32());
  mixer_->forward(h.f32(), T, out.f32(), memory, arena);
  float* o = out.f32();
  for (int64_t i = 0; i < T * D; ++i) x[i] += o[i];
  norm2_.forward(x, T, h.f32());
  ffn_->forward(h.f32(), T, out.f32(), arena);
  for (int64_t i = 0; i < T * D; ++i) x[i] += o[i];
}

void PreNormBlock::visit(const std::string& prefix, const ParamVisitor& v) {
  norm1_.visit(join_name(prefix, names_.norm1), v);
  mixer_->visit(join_name(prefix, names_.mixer), v);
  norm2_.visit(join_name(prefix, names_.norm2), v);
  ffn_->visit(join_name(prefix, names_.ffn), v);
}

}  // namespace k3
