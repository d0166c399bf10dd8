#include "mixers/attention/softmax_attention.h"

#include <cmath>

#include "ops/ag_conv.h"


namespace k3 {

SoftmaxAttention::SoftmaxAttention(const SoftmaxAttentionOptions& o)
    : c_attn(o.d_model, 3 * o.d_model, Bias::Present, o.layout),
      c_proj(o.d_model, o.d_model, Bias::Present, o.layout),
      o_(o),
      hd_(o.d_model / o.heads) {
  K3_CHECK(o.d_model % o.heads == 0, "d_model ", o.d_model, " not divisible by heads ", o.heads);
  K3_CHECK(o.conv_size >= 0, "attention: conv_size ", o.conv_size);
  if (o.conv_size > 0) c_attn_conv = parameter({3 * o.d_model, 1, o.conv_size});
}

// Short conv over q | k | v: from zero padding (no memories, differentiable) or continuing each
// sequence's conv tail kept in its KV cache (inference).
Var SoftmaxAttention::conv(const Var& qkv, const SeqBatch& batch) const {
  if (!c_attn_conv) return qkv;
  if (!batch.memories) return ag::silu(ag::short_conv(qkv, c_attn_conv, batch.B, batch.T));
  const int64_t T = batch.T, C = 3 * o_.d_model, W = o_.conv_size;
  Tensor y = Tensor::empty(qkv->value.shape());
  for (int64_t b = 0; b < batch.B; ++b) {
    auto* cache = static_cast<KVCache*>(batch.memories[b]);
    const float* xb = qkv->value.f32() + b * T * C;
    short_conv_forward(xb, c_attn_conv->value.f32(), cache->conv_tail(), T, C, W, y.f32() + b * T * C);
    if (cache->conv_tail()) short_conv_update_tail(xb, T, C, W, cache->conv_tail());
  }
  return ag::silu(constant(std::move(y)));
}

Var SoftmaxAttention::forward(const Var& x, const SeqBatch& batch) const {
  const int64_t D = o_.d_model, H = o_.heads, B = batch.B, T = batch.T;
  const float scale = 1.0f / std::sqrt(float(hd_));
  Var qkv = conv(c_attn(x), batch);  // [B*T, 3D] = q | k | v
  if (!batch.memories) {
    if (T > o_.max_positions)
      throw error("attention", "sequence of ", T, " tokens exceeds the model's ", o_.max_positions, " positions");
    Var att = ag::causal_attention(ag::slice_last(qkv, 0, D), ag::slice_last(qkv, D, 2 * D),
                                   ag::slice_last(qkv, 2 * D, 3 * D), B, T, H, scale);
    return c_proj(att);
  }
  // Continue each sequence from its KV cache (inference: no graph through the cache).
  return c_proj(constant(attend_cached(qkv->value, B, T, H, H, hd_, scale, batch.memories)));
}

std::unique_ptr<Memory> SoftmaxAttention::new_memory(int64_t max_tokens) const {
  return std::make_unique<KVCache>(o_.heads, hd_, std::min(max_tokens, o_.max_positions), 3 * o_.d_model,
                                   o_.conv_size, c_attn.weight->value.device());
}

std::vector<MemorySpec> SoftmaxAttention::memory_spec() const {
  std::vector<MemorySpec> s = {{MemoryKind::KVCache, double(2 * o_.d_model * sizeof(float)), 0}};
  if (o_.conv_size > 1) s.push_back({MemoryKind::ConvTail, 0, double((o_.conv_size - 1) * 3 * o_.d_model) * sizeof(float)});
  return s;
}

void SoftmaxAttention::visit(const std::string& prefix, const ParamVisitor& v) const {
  c_attn.visit(join_name(prefix, "c_attn"), v);
  if (c_attn_conv) v(join_name(prefix, "c_attn_conv.weight"), *c_attn_conv, ParamKind::Weight);
  c_proj.visit(join_name(prefix, "c_proj"), v);
}

}  // namespace k3
