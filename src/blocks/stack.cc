#include "blocks/stack.h"

#include <cmath>

#include "core/profile.h"
#include "ffn/moe.h"
#include "ops/ag.h"

namespace k3 {

BlockStack::BlockStack(AttnResidual rule) : attn_res_(std::move(rule)) {
  output_res_ = AttnResMix(attn_res_->D, attn_res_->eps);
}

void BlockStack::add(PreNormBlock block) {
  blocks_.push_back(std::move(block));
  if (attn_res_) {
    mixer_res_.emplace_back(attn_res_->D, attn_res_->eps);
    ffn_res_.emplace_back(attn_res_->D, attn_res_->eps);
  }
}

void BlockStack::visit_layer(size_t l, const std::string& prefix, const ParamVisitor& v) const {
  blocks_[l].visit(prefix, v);
  if (!attn_res_) return;
  const AttnResidual::Names& n = attn_res_->names;
  mixer_res_[l].visit(join_name(prefix, n.mixer_proj), join_name(prefix, n.mixer_norm), v);
  ffn_res_[l].visit(join_name(prefix, n.ffn_proj), join_name(prefix, n.ffn_norm), v);
}

void BlockStack::visit_stack(const std::string& model_prefix, const ParamVisitor& v) const {
  if (attn_res_)
    output_res_.visit(join_name(model_prefix, attn_res_->names.output_proj),
                      join_name(model_prefix, attn_res_->names.output_norm), v);
}

SeqBatch BlockStack::LayerBatches::operator()(size_t l) {
  if (!contexts_) return SeqBatch{B_, T_, nullptr};
  for (int64_t b = 0; b < B_; ++b) mems_[size_t(b)] = contexts_[b]->layers[l].get();
  return SeqBatch{B_, T_, mems_.data()};
}

Var BlockStack::forward(Var x, int64_t B, int64_t T, Context* const* contexts) const {
  if (attn_res_) return forward_attn_res(std::move(x), B, T, contexts);
  LayerBatches lb(B, T, contexts);
  for (size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l].forward(x, lb(l));
  advance_positions(contexts, B, T);
  return x;
}

// x is the running partial sum p of the current block; `blocks` holds the completed blocks' sums.
Var BlockStack::forward_attn_res(Var x, int64_t B, int64_t T, Context* const* contexts) const {
  LayerBatches lb(B, T, contexts);
  std::vector<Var> blocks;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const SeqBatch sb = lb(l);
    std::optional<profile::Scope> res(std::in_place, "attention residuals");
    Var h = mixer_res_[l](blocks, x);
    res.reset();
    Var p = x;
    if (int64_t(l) % attn_res_->block_size == 0) {
      blocks.push_back(x);  // seal: push the raw prefix, not h
      p = nullptr;
    }
    Var a = blocks_[l].mix(h, sb);
    p = p ? ag::add(p, a) : a;
    res.emplace("attention residuals");
    Var m_in = ffn_res_[l](blocks, p);
    res.reset();
    x = ag::add(p, blocks_[l].feed(m_in));
  }
  const profile::Scope res("attention residuals");
  x = output_res_(blocks, x);
  advance_positions(contexts, B, T);
  return x;
}

void advance_positions(Context* const* contexts, int64_t B, int64_t T) {
  if (contexts)
    for (int64_t b = 0; b < B; ++b) contexts[b]->position += T;
}

std::vector<LayerMemory> BlockStack::memory_layers() const {
  std::vector<LayerMemory> out;
  for (size_t l = 0; l < blocks_.size(); ++l)
    for (const auto& s : blocks_[l].mixer().memory_spec()) out.push_back({int64_t(l), s});
  return out;
}

Context BlockStack::new_context(int64_t max_tokens) const {
  Context ctx;
  for (const auto& b : blocks_) ctx.layers.push_back(b.mixer().new_memory(max_tokens));
  return ctx;
}

int64_t BlockStack::idle_expert_params() const {
  int64_t n = 0;
  for (const auto& b : blocks_)
    if (auto* moe = dynamic_cast<const MoE*>(&b.ffn())) n += moe->total_params() - moe->active_params();
  return n;
}

double BlockStack::idle_expert_params(int64_t tokens) const {
  double n = 0;
  for (const auto& b : blocks_)
    if (auto* moe = dynamic_cast<const MoE*>(&b.ffn())) {
      const double E = double(moe->opts.n_experts), k = double(moe->opts.top_k);
      n += double(moe->experts.front().active_params()) * E * std::pow(1.0 - k / E, double(tokens));
    }
  return n;
}

void BlockStack::balance_experts(float gamma) const {
  for (const auto& b : blocks_)
    if (auto* moe = dynamic_cast<const MoE*>(&b.ffn())) const_cast<MoE*>(moe)->apply_bias_update(gamma);
}

Var BlockStack::balance_loss(int64_t seq_len, float alpha) const {
  Var total;
  for (const auto& b : blocks_)
    if (auto* moe = dynamic_cast<const MoE*>(&b.ffn())) {
      Var l = moe->balance_loss(seq_len, alpha);
      total = total ? ag::add(total, l) : l;
    }
  return total;
}

}  // namespace k3
