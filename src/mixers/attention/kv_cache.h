// KV cache of softmax attention: K and V of every past token, head-major [H, capacity, hd] so
// that one head's keys are contiguous for the decode kernel. Grows by doubling. Optionally also
// the conv tail [W−1, C] of a short convolution in front of attention (conv_size W > 1).
#pragma once

#include <vector>

#include "mixers/memory.h"
#include "ops/attention.h"

namespace k3 {

class KVCache final : public Memory {
 public:
  KVCache(int64_t heads, int64_t head_dim, int64_t max_tokens, int64_t conv_channels = 0, int64_t conv_size = 0);
  MemoryKind kind() const override { return MemoryKind::KVCache; }
  void reset() override;
  std::unique_ptr<Memory> clone() const override { return std::make_unique<KVCache>(*this); }
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return (k_.capacity() + v_.capacity() + tail_.size()) * sizeof(float); }
  int64_t length() const override { return length_; }
  void extend_zeros(int64_t n) override;

  // Appends n tokens read from [n, H, hd] views.
  void append(const HeadView& k, const HeadView& v, int64_t n);
  HeadView keys() { return {k_.data(), head_dim_, capacity_ * head_dim_}; }
  HeadView values() { return {v_.data(), head_dim_, capacity_ * head_dim_}; }
  int64_t max_tokens() const { return max_tokens_; }
  float* conv_tail() { return tail_.empty() ? nullptr : tail_.data(); }  // [W−1, C], oldest first

 private:
  void grow(int64_t need);
  int64_t heads_, head_dim_, max_tokens_, conv_channels_, conv_size_;
  int64_t capacity_ = 0, length_ = 0;
  std::vector<float> k_, v_;  // [H, capacity, hd]
  std::vector<float> tail_;   // [conv_size − 1, conv_channels] or empty
};

}  // namespace k3
