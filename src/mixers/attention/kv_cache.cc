#include "mixers/attention/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "core/device.h"
#include "core/error.h"
#include "mixers/mixers_cuda.h"

namespace k3 {

KVCache::KVCache(int64_t heads, int64_t head_dim, int64_t max_tokens, int64_t conv_channels, int64_t conv_size,
                 Device device)
    : heads_(heads),
      head_dim_(head_dim),
      conv_channels_(conv_channels),
      conv_size_(conv_size),
      rows_("kv-cache", {heads * head_dim, heads * head_dim}, max_tokens, device) {
  if (conv_size > 1) {
    if (device != Device::CPU)
      throw error("attention", "the short-conv attention variant keeps its conv tails on the CPU: decode it with --device cpu");
    tail_ = Tensor::zeros({conv_size - 1, conv_channels});
  }
}

void KVCache::reset() {
  rows_.reset();
  if (tail_.numel()) tail_.zero();
}

std::unique_ptr<Memory> KVCache::clone() const {
  auto c = std::make_unique<KVCache>(*this);
  c->rows_ = rows_.clone();
  if (tail_.numel()) c->tail_ = tail_.clone();
  return c;
}

std::unique_ptr<Memory> KVCache::clone_to(Device device) const {
  auto c = std::make_unique<KVCache>(*this);
  c->rows_ = rows_.clone_to(device);
  if (tail_.numel()) c->tail_ = tail_.device() == device ? tail_.clone() : tail_.to_device(device);
  return c;
}

void KVCache::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const KVCache*>(&snapshot);
  K3_CHECK(s && s->heads_ == heads_ && s->head_dim_ == head_dim_ && s->tail_.numel() == tail_.numel(),
           "KVCache::restore from another kind");
  rows_.restore(s->rows_);
  if (tail_.numel()) tail_.copy_from(s->tail_);
}

void KVCache::set_length(int64_t n) {
  if (rows_.device() != Device::CUDA) Memory::set_length(n);
  rows_.set_length(n);
}

void KVCache::truncate(int64_t n) {
  if (!can_truncate()) Memory::truncate(n);
  rows_.truncate(n);
}

void KVCache::extend_zeros(int64_t n) {
  rows_.extend_zeros(n);
  // The conv tail shifts in n zero inputs.
  if (tail_.numel()) {
    float* tail = tail_.f32();
    const int64_t C = conv_channels_, rows = conv_size_ - 1, keep = std::max<int64_t>(0, rows - n);
    std::memmove(tail, tail + (rows - keep) * C, size_t(keep * C) * sizeof(float));
    std::fill(tail + keep * C, tail + rows * C, 0.0f);
  }
}

void KVCache::append(const HeadView& k, const HeadView& v, int64_t n) {
  K3_CHECK(rows_.device() == Device::CPU, "kv-cache: host rows appended to a CUDA cache");
  rows_.reserve(n);
  const int64_t D = heads_ * head_dim_, t0 = rows_.length();
  float* ks = rows_.f32(0) + t0 * D;
  float* vs = rows_.f32(1) + t0 * D;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads_; ++h) {
      std::memcpy(ks + t * D + h * head_dim_, k.at(t, h), size_t(head_dim_) * 4);
      std::memcpy(vs + t * D + h * head_dim_, v.at(t, h), size_t(head_dim_) * 4);
    }
  rows_.advance(n);
}

Tensor attend_cached(const Tensor& qkv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hd, float scale,
                     Memory* const* memories) {
  K3_CHECK(Hkv > 0 && H % Hkv == 0, "attention: ", H, " heads cannot share ", Hkv, " key/value heads");
  const int64_t D = H * hd, Dkv = Hkv * hd, W = D + 2 * Dkv, group = H / Hkv;
  K3_CHECK(qkv.numel() == B * T * W && qkv.is_contiguous(), "attention: qkv ", qkv.describe(), " for B=", B, " T=", T,
           " width ", W);
  if (qkv.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) return gpu::cached_attention(qkv, B, T, H, Hkv, hd, scale, memories);
  }
  std::vector<KVCache*> caches(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {  // all or none
    caches[size_t(b)] = dynamic_cast<KVCache*>(memories[b]);
    K3_CHECK(caches[size_t(b)] && caches[size_t(b)]->rows().device() == Device::CPU, "attention: sequence ", b,
             "'s memory is not a host KV cache");
    caches[size_t(b)]->rows().reserve(T);
  }
  Tensor att = Tensor::empty({B * T, D});  // [B*T, H, hd]
  for (int64_t b = 0; b < B; ++b) {
    KVCache* cache = caches[size_t(b)];
    float* base = qkv.f32() + b * T * W;
    HeadView q{base, W, hd}, k{base + D, W, hd}, v{base + D + Dkv, W, hd};
    AttentionShape s{T, 0, H, hd, cache->length(), scale};
    cache->append(k, v, T);
    s.S = cache->length();
    attention_forward(q, cache->keys(group), cache->values(group), HeadView{att.f32() + b * T * D, D, hd}, s);
  }
  return att;
}

}  // namespace k3
