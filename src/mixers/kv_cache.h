// KV cache of softmax attention: K and V of every past token, head-major [H, capacity, hd] so
// that one head's keys are contiguous for the decode kernel. Grows by doubling.
#pragma once

#include <vector>

#include "mixers/memory.h"
#include "ops/attention.h"

namespace k3 {

class KVCache final : public Memory {
 public:
  KVCache(int64_t heads, int64_t head_dim, int64_t max_tokens);
  MemoryKind kind() const override { return MemoryKind::KVCache; }
  void reset() override { length_ = 0; }
  std::unique_ptr<Memory> clone() const override { return std::make_unique<KVCache>(*this); }
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return (k_.capacity() + v_.capacity()) * sizeof(float); }
  int64_t length() const override { return length_; }
  void extend_zeros(int64_t n) override;

  // Appends n tokens read from [n, H, hd] views.
  void append(const HeadView& k, const HeadView& v, int64_t n);
  HeadView keys() { return {k_.data(), head_dim_, capacity_ * head_dim_}; }
  HeadView values() { return {v_.data(), head_dim_, capacity_ * head_dim_}; }
  int64_t max_tokens() const { return max_tokens_; }

 private:
  void grow(int64_t need);
  int64_t heads_, head_dim_, max_tokens_;
  int64_t capacity_ = 0, length_ = 0;
  std::vector<float> k_, v_;  // [H, capacity, hd]
};

}  // namespace k3
