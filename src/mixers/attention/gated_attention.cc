#include "mixers/attention/gated_attention.h"

#include <cmath>

#include "ops/ag_heads.h"

namespace k3 {

GatedAttention::GatedAttention(const GatedAttentionOptions& o)
    : o_(o),
      q_proj_(o.d_model, 2 * o.heads * o.head_dim, Bias::None),
      k_proj_(o.d_model, o.kv_heads * o.head_dim, Bias::None),
      v_proj_(o.d_model, o.kv_heads * o.head_dim, Bias::None),
      o_proj_(o.heads * o.head_dim, o.d_model, Bias::None),
      q_norm_(NormType::RMSNorm, o.head_dim, o.eps, NormWeight::ZeroCentred),
      k_norm_(NormType::RMSNorm, o.head_dim, o.eps, NormWeight::ZeroCentred) {
  K3_CHECK(o.d_model > 0 && o.heads > 0 && o.kv_heads > 0 && o.head_dim > 0 && o.heads % o.kv_heads == 0,
           "gated attention: ", o.heads, " heads cannot share ", o.kv_heads, " key/value heads");
  K3_CHECK(o.rope_dim >= 0 && o.rope_dim <= o.head_dim && o.rope_dim % 2 == 0, "gated attention: rotary dims ",
           o.rope_dim, " of heads of ", o.head_dim);
  rope_ = make_rope(o.rope_dim, o.rope_theta);
  rope_.half_pairs = true;
}

Var GatedAttention::per_head_norm(const Norm& n, const Var& x, int64_t heads) const {
  const int64_t M = x->value.dim(0);
  return ag::reshape(n(ag::reshape(x, {M * heads, o_.head_dim})), {M, heads * o_.head_dim});
}

Var GatedAttention::repeat_kv(const Var& x) const {
  const int64_t group = o_.heads / o_.kv_heads;
  if (group == 1) return x;
  const int64_t M = x->value.dim(0);
  return ag::reshape(ag::broadcast_heads(ag::reshape(x, {M * o_.kv_heads, o_.head_dim}), group),
                     {M, o_.heads * o_.head_dim});
}

Var GatedAttention::forward(const Var& x, const SeqBatch& batch) const {
  const int64_t H = o_.heads, hd = o_.head_dim, B = batch.B, T = batch.T, M = B * T;
  if (!batch.memories && T > o_.max_positions)
    throw error("attention", "sequence of ", T, " tokens exceeds the model's ", o_.max_positions, " positions");
  // Each sequence's positions continue its cache (from 0 without memories).
  std::vector<int64_t> pos(static_cast<size_t>(M));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) pos[size_t(b * T + t)] = (batch.memories ? batch.memories[b]->length() : 0) + t;
  const std::vector<Var> px = apply_each({&q_proj_, &k_proj_, &v_proj_}, x);
  Var q = per_head_norm(q_norm_, ag::head_slice(px[0], H, 0, hd), H);
  const Var gate = ag::head_slice(px[0], H, hd, 2 * hd);
  Var k = per_head_norm(k_norm_, px[1], o_.kv_heads);
  if (o_.rope_dim > 0) {
    q = ag::rope(q, pos, H, 0, rope_);
    k = ag::rope(k, pos, o_.kv_heads, 0, rope_);
  }
  const float scale = 1.0f / std::sqrt(float(hd));
  // Cached: the caches keep the key/value heads once (grouped-query attention reads them shared);
  // otherwise the heads are repeated for causal_attention.
  Var att = batch.memories ? constant(attend_cached(ag::concat_last({q, k, px[2]})->value, B, T, H, o_.kv_heads, hd,
                                                    scale, batch.memories))
                           : ag::causal_attention(q, repeat_kv(k), repeat_kv(px[2]), B, T, H, scale);
  return o_proj_(ag::mul(att, ag::sigmoid(gate)));
}

std::unique_ptr<Memory> GatedAttention::new_memory(int64_t max_tokens) const {
  return std::make_unique<KVCache>(o_.kv_heads, o_.head_dim, std::min(max_tokens, o_.max_positions), 0, 0,
                                   o_proj_.weight->value.device());
}

std::vector<MemorySpec> GatedAttention::memory_spec() const {
  return {{MemoryKind::KVCache, double(2 * o_.kv_heads * o_.head_dim * sizeof(float)), 0}};
}

void GatedAttention::visit(const std::string& prefix, const ParamVisitor& v) const {
  q_proj_.visit(join_name(prefix, "q_proj"), v);
  k_proj_.visit(join_name(prefix, "k_proj"), v);
  v_proj_.visit(join_name(prefix, "v_proj"), v);
  o_proj_.visit(join_name(prefix, "o_proj"), v);
  q_norm_.visit(join_name(prefix, "q_norm"), v);
  k_norm_.visit(join_name(prefix, "k_norm"), v);
}

}  // namespace k3
