#include "mixers/mla/mla.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/profile.h"
#include "ops/ag_heads.h"
#include "mixers/mixers_cuda.h"
#include "ops/gemm.h"

namespace k3 {

void LatentCache::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const LatentCache*>(&snapshot);
  K3_CHECK(s && s->width_ == width_, "LatentCache::restore from another kind");
  *this = *s;
}

void LatentCache::extend_zeros(int64_t n) {
  if (length_ + n > max_tokens_) throw error("mla", "context of ", length_ + n, " exceeds ", max_tokens_);
  rows_.resize(size_t((length_ + n) * width_), 0.0f);
  length_ += n;
}

void LatentCache::append(const float* rows, int64_t n) {
  if (length_ + n > max_tokens_)
    throw error("mla", "context of ", length_ + n, " tokens exceeds the limit of ", max_tokens_);
  rows_.resize(size_t((length_ + n) * width_));
  std::memcpy(rows_.data() + length_ * width_, rows, size_t(n * width_) * 4);
  length_ += n;
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
  const int64_t H = o_.heads, B = batch.B, T = batch.T, R = o_.kv_lora_rank, rd = o_.qk_rope_head_dim;
  const int64_t nope = o_.qk_nope_head_dim, vd = o_.v_head_dim, qd = nope + rd, W = R + rd;
  if constexpr (device::kCudaBuilt) {
    if (x->value.device() == Device::CUDA) {
      // Every sequence's positions continue its own cache; the new latent rows [c ; k_rope] and
      // the absorbed attention over them run on the device (mixers_cuda.h).
      std::vector<int64_t> pos(static_cast<size_t>(B * T));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) pos[size_t(b * T + t)] = batch.memories[b]->length() + t;
      // x's projections (query, latent rows, output gate) in one grouped GEMM (apply_each).
      std::vector<const Linear*> ls = {o_.q_lora_rank ? &q_a_proj_ : &q_proj_, &kv_a_proj_};
      if (o_.gate == OutputGate::Sigmoid) ls.push_back(&g_proj_);
      const std::vector<Var> px = apply_each(ls, x);
      Var q = queries_from(px[0], pos);
      Var kv = px[1];
      Var c = kv_a_norm_(ag::slice_last(kv, 0, R));
      Var k_rope = ag::slice_last(kv, R, R + rd);
      if (o_.position == MlaPosition::Rope) k_rope = ag::rope(k_rope, pos, 1, 0, rope_);
      Var rows = ag::concat_last({c, k_rope});
      Var a = constant(gpu::latent_attention(q->value, rows->value, kv_b_proj_.weight->value,
                                             gpu::LatentShape{B, T, H, nope, rd, vd, R, scale_}, batch.memories));
      if (o_.gate == OutputGate::Sigmoid) a = ag::mul(a, ag::sigmoid(px[2]));
      return o_proj_(a);
    }
  }
  const float* wkv = kv_b_proj_.weight->value.f32();  // [H*(nope+v), R]
  Tensor att = Tensor::empty({B * T, H * vd});
  std::optional<profile::Scope> scope(std::in_place, "latent attention");  // the projections included
  for (int64_t b = 0; b < B; ++b) {
    auto* cache = static_cast<LatentCache*>(batch.memories[b]);
    const int64_t p0 = cache->length();
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
    Var xb = constant(x->value.slice(0, b * T, (b + 1) * T).clone());
    Var q = queries(xb, pos);  // [T, H*qd]
    Var kv = kv_a_proj_(xb);
    Var c = kv_a_norm_(ag::slice_last(kv, 0, R));
    Var k_rope = ag::slice_last(kv, R, R + rd);
    if (o_.position == MlaPosition::Rope) k_rope = ag::rope(k_rope, pos, 1, 0, rope_);
    std::vector<float> rows(static_cast<size_t>(T * W));
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(rows.data() + t * W, c->value.f32() + t * R, size_t(R) * 4);
      std::memcpy(rows.data() + t * W + R, k_rope->value.f32() + t * rd, size_t(rd) * 4);
    }
    cache->append(rows.data(), T);
    const int64_t S = cache->length();
    const float* lat = cache->data();  // [S, W]
    std::vector<float> qt(static_cast<size_t>(W)), p(static_cast<size_t>(S)), ob(static_cast<size_t>(R));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = q->value.f32() + (t * H + h) * qd;
        const float* wuk = wkv + h * (nope + vd) * R;  // [nope, R]
        // q̃ = W_UKᵀ q_nope (R values), then the rope part unchanged: a query over [c ; k_rope].
        gemm(Trans::No, Trans::No, 1, R, nope, 1.0f, qh, nope, wuk, R, 0.0f, qt.data(), R);
        std::memcpy(qt.data() + R, qh + nope, size_t(rd) * 4);
        const int64_t n = p0 + t + 1;
        gemm(Trans::No, Trans::Yes, 1, n, W, scale_, qt.data(), W, lat, W, 0.0f, p.data(), n);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[size_t(j)]);
        double z = 0;
        for (int64_t j = 0; j < n; ++j) z += p[size_t(j)] = std::exp(p[size_t(j)] - mx);
        for (int64_t j = 0; j < n; ++j) p[size_t(j)] = float(p[size_t(j)] / z);
        // ō = Σ p_s c_s (R), then o_h = W_UV ō.
        gemm(Trans::No, Trans::No, 1, R, n, 1.0f, p.data(), n, lat, W, 0.0f, ob.data(), R);
        const float* wuv = wuk + nope * R;  // [v, R]
        gemm(Trans::No, Trans::Yes, 1, vd, R, 1.0f, ob.data(), R, wuv, R, 0.0f, att.f32() + (b * T + t) * H * vd + h * vd, vd);
      }
  }
  scope.reset();
  Var a = constant(std::move(att));
  if (o_.gate == OutputGate::Sigmoid) a = ag::mul(a, ag::sigmoid(g_proj_(x)));
  return o_proj_(a);
}

std::unique_ptr<Memory> Mla::new_memory(int64_t max_tokens) const {
  if constexpr (device::kCudaBuilt)
    if (kv_a_proj_.weight->value.device() == Device::CUDA)
      return gpu::latent_cache(o_.kv_lora_rank + o_.qk_rope_head_dim, std::min(max_tokens, o_.max_positions),
                               gpu::latent_storage());
  return std::make_unique<LatentCache>(o_.kv_lora_rank + o_.qk_rope_head_dim, std::min(max_tokens, o_.max_positions));
}

std::vector<MemorySpec> Mla::memory_spec() const {
  double bytes = sizeof(float);  // per latent value
  if constexpr (device::kCudaBuilt)
    if (kv_a_proj_.weight->value.device() == Device::CUDA && gpu::latent_storage() == device::Storage::BF16) bytes = 2;
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
