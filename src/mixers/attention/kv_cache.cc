#include "mixers/attention/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace k3 {

KVCache::KVCache(int64_t heads, int64_t head_dim, int64_t max_tokens, int64_t conv_channels, int64_t conv_size)
    : heads_(heads), head_dim_(head_dim), max_tokens_(max_tokens), conv_channels_(conv_channels), conv_size_(conv_size) {
  if (conv_size > 1) tail_.assign(size_t((conv_size - 1) * conv_channels), 0.0f);
}

void KVCache::reset() {
  length_ = 0;
  std::fill(tail_.begin(), tail_.end(), 0.0f);
}

void KVCache::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const KVCache*>(&snapshot);
  K3_CHECK(s && s->heads_ == heads_ && s->head_dim_ == head_dim_ && s->tail_.size() == tail_.size(),
           "KVCache::restore from another kind");
  *this = *s;
}

void KVCache::grow(int64_t need) {
  int64_t cap = std::max<int64_t>(capacity_, 16);
  while (cap < need) cap *= 2;
  cap = std::min(cap, std::max(max_tokens_, need));
  std::vector<float> nk(size_t(heads_ * cap * head_dim_)), nv(nk.size());
  for (int64_t h = 0; length_ > 0 && h < heads_; ++h) {
    std::memcpy(nk.data() + h * cap * head_dim_, k_.data() + h * capacity_ * head_dim_, size_t(length_ * head_dim_) * 4);
    std::memcpy(nv.data() + h * cap * head_dim_, v_.data() + h * capacity_ * head_dim_, size_t(length_ * head_dim_) * 4);
  }
  k_.swap(nk);
  v_.swap(nv);
  capacity_ = cap;
}

void KVCache::extend_zeros(int64_t n) {
  if (length_ + n > max_tokens_) throw error("kv-cache", "context of ", length_ + n, " exceeds ", max_tokens_);
  if (length_ + n > capacity_) grow(length_ + n);
  length_ += n;  // grow() zero-fills new capacity
  // The conv tail shifts in n zero inputs.
  const int64_t keep = std::max<int64_t>(0, conv_size_ - 1 - n);
  if (!tail_.empty()) {
    const size_t C = size_t(conv_channels_);
    std::memmove(tail_.data(), tail_.data() + tail_.size() - size_t(keep) * C, size_t(keep) * C * sizeof(float));
    std::fill(tail_.begin() + std::ptrdiff_t(size_t(keep) * C), tail_.end(), 0.0f);
  }
}

void KVCache::append(const HeadView& k, const HeadView& v, int64_t n) {
  if (length_ + n > max_tokens_)
    throw error("kv-cache", "context of ", length_ + n, " tokens exceeds the model's maximum of ", max_tokens_,
                " positions");
  if (length_ + n > capacity_) grow(length_ + n);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads_; ++h) {
      std::memcpy(k_.data() + (h * capacity_ + length_ + t) * head_dim_, k.at(t, h), size_t(head_dim_) * 4);
      std::memcpy(v_.data() + (h * capacity_ + length_ + t) * head_dim_, v.at(t, h), size_t(head_dim_) * 4);
    }
  length_ += n;
}

}  // namespace k3
