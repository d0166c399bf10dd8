#include "models/mtp.h"

#include "models/lm_head.h"
#include "models/model.h"

namespace k3 {

MtpHead::MtpHead(PreNormBlock block, int64_t d_model, int64_t vocab, float eps, Var embed)
    : d_(d_model), embed_(std::move(embed)), eh_proj_(parameter({d_model, 2 * d_model})),
      head_(parameter({vocab, d_model})), enorm_(NormType::RMSNorm, d_model, eps),
      hnorm_(NormType::RMSNorm, d_model, eps), norm_(NormType::RMSNorm, d_model, eps) {
  block_.add(std::move(block));
}

void MtpHead::visit(const std::string& prefix, const ParamVisitor& v) const {
  enorm_.visit(prefix + ".enorm", v);
  hnorm_.visit(prefix + ".hnorm", v);
  v(prefix + ".eh_proj.weight", *eh_proj_, ParamKind::Weight);
  block_.visit_layer(0, prefix, v);
  norm_.visit(prefix + ".shared_head.norm", v);
  v(prefix + ".shared_head.head.weight", *head_, ParamKind::Weight);
}

Context MtpHead::new_context(int64_t max_tokens) const { return block_.new_context(max_tokens); }

Var MtpHead::forward(const Var& prev, const std::vector<int64_t>& next_ids, Context* ctx) const {
  const int64_t T = int64_t(next_ids.size());
  if (prev->value.ndim() != 2 || prev->value.dim(0) != T || prev->value.dim(1) != d_)
    throw error("mtp", "hidden states ", prev->value.describe(), " for ", T, " tokens of width ", d_);
  const Var e = enorm_(ag::embedding(embed_, next_ids, std::nullopt));
  const Var x = ag::linear(ag::concat_last({e, hnorm_(prev)}), eh_proj_, nullptr, WeightLayout::OutIn);
  Context* ctxs[1] = {ctx};
  return block_.forward(x, 1, T, ctx ? ctxs : nullptr);
}

int64_t MtpHead::pick(const Var& o) const {
  const int64_t T = o->value.dim(0);
  const std::vector<int64_t> unused(size_t(T), 0);
  int64_t next = 0;
  head_picks(norm_(o), TokenBatch{unused.data(), 1, T, nullptr}, head_, &next);
  return next;
}

}  // namespace k3
