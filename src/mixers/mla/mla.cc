#include "mixers/mla/mla.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/profile.h"
#include "ops/ag_heads.h"
#include "mixers/mla/latent_attention.h"
#include "ops/gemm.h"

namespace k3 {

namespace {
DType g_latent_storage = DType::F32;
}  // namespace
void set_latent_storage(DType dtype) {
  K3_CHECK(dtype == DType::F32 || dtype == DType::BF16, "mla: latent caches of ", dtype_name(dtype));
  g_latent_storage = dtype;
}
DType latent_storage() { return g_latent_storage; }

LatentCache::LatentCache(int64_t width, int64_t max_tokens, Device device)
    : rows_("mla", {width}, max_tokens, device, device == Device::CUDA ? latent_storage() : DType::F32) {}

size_t LatentCache::value_bytes(Device device) {
  return dtype_size(device == Device::CUDA ? latent_storage() : DType::F32);
}

std::unique_ptr<Memory> LatentCache::clone() const {
  auto c = std::make_unique<LatentCache>(*this);
  c->rows_ = rows_.clone();
  return c;
}

std::unique_ptr<Memory> LatentCache::clone_to(Device device) const {
  auto c = std::make_unique<LatentCache>(*this);
  c->rows_ = rows_.clone_to(device);
  return c;
}

void LatentCache::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const LatentCache*>(&snapshot);
  K3_CHECK(s, "LatentCache::restore from another kind");
  rows_.restore(s->rows_);
}

void LatentCache::set_length(int64_t n) {
  if (rows_.device() != Device::CUDA) Memory::set_length(n);
  rows_.set_length(n);
}

void LatentCache::append(const float* rows, int64_t n) {
  K3_CHECK(rows_.device() == Device::CPU, "mla: host rows appended to a CUDA latent cache");
  rows_.reserve(n);
  rows_.append(0, rows, width(), n);
  rows_.advance(n);
}

Mla::Mla(const MlaOptions& o) : o_(o) {
  const int64_t D = o.d_model, H = o.heads, qd = o.qk_nope_head_dim + o.qk_rope_head_dim;
  if (o.q_lora_rank) {
    q_a_proj_ = Linear(D, *o.q_lora_rank, Bias::None);
    q_a_norm_ = Norm(NormType::RMSNorm, *o.q_lora_rank, o.latent_norm_eps);
    q_b_proj_ = Linear(*o.q_lora_rank, H * qd, Bias::None);
  } else {
    q_proj_ = Linear(D, H * qd, Bias::None);
  }
  kv_a_proj_ = Linear(D, o.kv_lora_rank + o.qk_rope_head_dim, Bias::None);
  kv_a_norm_ = Norm(NormType::RMSNorm, o.kv_lora_rank, o.latent_norm_eps);
  kv_b_proj_ = Linear(o.kv_lora_rank, H * (o.qk_nope_head_dim + o.v_head_dim), Bias::None);
  o_proj_ = Linear(H * o.v_head_dim, D, Bias::None);
  if (o.gate == OutputGate::Sigmoid) g_proj_ = Linear(D, H * o.v_head_dim, Bias::None);
  rope_ = make_rope(o.qk_rope_head_dim, o.rope_theta, o.yarn);
  // softmax scale = (nope + rope)^-1/2, times mscale² under YaRN (spec §6).
  scale_ = float(1.0 / std::sqrt(double(qd)));
  if (o.yarn && o.yarn->mscale_all_dim != 0.0) {
    double m = yarn_mscale(o.yarn->factor, o.yarn->mscale_all_dim);
    scale_ = float(scale_ * m * m);
  }
}

Var Mla::queries(const Var& x, const std::vector<int64_t>& pos) const {
  return queries_from(o_.q_lora_rank ? q_a_proj_(x) : q_proj_(x), pos);
}

Var Mla::queries_from(const Var& first, const std::vector<int64_t>& pos) const {
  Var q = o_.q_lora_rank ? q_b_proj_(q_a_norm_(first)) : first;
  if (o_.position == MlaPosition::Rope) q = ag::rope(q, pos, o_.heads, o_.qk_nope_head_dim, rope_);
  return q;
}

Var Mla::forward(const Var& x, const SeqBatch& batch) const {
  if (batch.memories) return absorbed(x, batch);
  const int64_t H = o_.heads, B = batch.B, T = batch.T, M = B * T;
  if (T > o_.max_positions) throw error("mla", "sequence of ", T, " tokens exceeds ", o_.max_positions, " positions");
  std::vector<int64_t> pos(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) pos[size_t(i)] = i % T;
  Var q = queries(x, pos);                                        // [M, H*(nope+rope)]
  Var kv = kv_a_proj_(x);                                         // [M, kv_lora + rope]
  Var c = kv_a_norm_(ag::slice_last(kv, 0, o_.kv_lora_rank));     // [M, kv_lora]
  Var k_rope = ag::slice_last(kv, o_.kv_lora_rank, o_.kv_lora_rank + o_.qk_rope_head_dim);  // [M, rope]
  if (o_.position == MlaPosition::Rope) k_rope = ag::rope(k_rope, pos, 1, 0, rope_);
  Var kvb = kv_b_proj_(c);                                        // [M, H*(nope+v)]
  Var k_nope = ag::head_slice(kvb, H, 0, o_.qk_nope_head_dim);
  Var v = ag::head_slice(kvb, H, o_.qk_nope_head_dim, o_.qk_nope_head_dim + o_.v_head_dim);
  Var k = ag::head_concat({k_nope, ag::broadcast_heads(k_rope, H)}, H);  // [M, H*(nope+rope)]
  Var att = ag::causal_attention(q, k, v, B, T, H, scale_);      // [M, H*v]
  if (o_.gate == OutputGate::Sigmoid) att = ag::mul(att, ag::sigmoid(g_proj_(x)));
  return o_proj_(att);
}

// Weight absorption (spec §6): score_h(s) = (W_UK[h]ᵀ q_nope_h · c_s + q_rope_h · k_rope_s)·scale,
// o_h = W_UV[h] Σ_s p_h(s) c_s. Inference only: no graph through the cache.
Var Mla::absorbed(const Var& x, const SeqBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  // Every sequence's positions continue its own cache.
  std::vector<int64_t> pos(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) pos[size_t(b * T + t)] = batch.memories[b]->length() + t;
  // x's projections (query, latent rows, output gate) in one grouped GEMM (apply_each).
  std::vector<const Linear*> ls = {o_.q_lora_rank ? &q_a_proj_ : &q_proj_, &kv_a_proj_};
  if (o_.gate == OutputGate::Sigmoid) ls.push_back(&g_proj_);
  const std::vector<Var> px = apply_each(ls, x);
  const int64_t R = o_.kv_lora_rank, rd = o_.qk_rope_head_dim;
  Var q = queries_from(px[0], pos);
  Var c = kv_a_norm_(ag::slice_last(px[1], 0, R));
  Var k_rope = ag::slice_last(px[1], R, R + rd);
  if (o_.position == MlaPosition::Rope) k_rope = ag::rope(k_rope, pos, 1, 0, rope_);
  Var rows = ag::concat_last({c, k_rope});  // the new latent rows [c ; k_rope]
  Var a = constant(attend_latents(q->value, rows->value, kv_b_proj_.weight->value,
                                  LatentShape{B, T, o_.heads, o_.qk_nope_head_dim, rd, o_.v_head_dim, R, scale_},
                                  batch.memories));
  if (o_.gate == OutputGate::Sigmoid) a = ag::mul(a, ag::sigmoid(px[2]));
  return o_proj_(a);
}

std::unique_ptr<Memory> Mla::new_memory(int64_t max_tokens) const {
  return std::make_unique<LatentCache>(o_.kv_lora_rank + o_.qk_rope_head_dim, std::min(max_tokens, o_.max_positions),
                                       kv_a_proj_.weight->value.device());
}

std::vector<MemorySpec> Mla::memory_spec() const {
  const double bytes = double(LatentCache::value_bytes(kv_a_proj_.weight->value.device()));
  return {{MemoryKind::LatentCache, double(o_.kv_lora_rank + o_.qk_rope_head_dim) * bytes, 0}};
}

void Mla::visit(const std::string& prefix, const ParamVisitor& v) const {
  if (o_.q_lora_rank) {
    q_a_proj_.visit(join_name(prefix, "q_a_proj"), v);
    q_a_norm_.visit(join_name(prefix, "q_a_layernorm"), v);
    q_b_proj_.visit(join_name(prefix, "q_b_proj"), v);
  } else {
    q_proj_.visit(join_name(prefix, "q_proj"), v);
  }
  kv_a_proj_.visit(join_name(prefix, "kv_a_proj_with_mqa"), v);
  kv_a_norm_.visit(join_name(prefix, "kv_a_layernorm"), v);
  kv_b_proj_.visit(join_name(prefix, "kv_b_proj"), v);
  o_proj_.visit(join_name(prefix, "o_proj"), v);
  if (o_.gate == OutputGate::Sigmoid) g_proj_.visit(join_name(prefix, "g_proj"), v);
}

}  // namespace k3
