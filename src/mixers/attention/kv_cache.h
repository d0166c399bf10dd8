// KV cache of softmax attention: K and V of every past token, token-major rows [capacity, H·hd]
// (mixers/token_rows.h: grown on the host, allocated up front on CUDA), on the device of the layer
// that made it. Optionally also the conv tail [W−1, C] of a short convolution in front of
// attention (conv_size W > 1; host only).
#pragma once

#include "mixers/memory.h"
#include "mixers/token_rows.h"
#include "ops/attention.h"

namespace k3 {

class KVCache final : public Memory {
 public:
  KVCache(int64_t heads, int64_t head_dim, int64_t max_tokens, int64_t conv_channels = 0, int64_t conv_size = 0,
          Device device = Device::CPU);
  MemoryKind kind() const override { return MemoryKind::KVCache; }
  void reset() override;
  std::unique_ptr<Memory> clone() const override;
  std::unique_ptr<Memory> clone_to(Device device) const override;
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return rows_.bytes() + tail_.nbytes(); }
  int64_t length() const override { return rows_.length(); }
  int64_t capacity() const override { return rows_.max_tokens(); }
  void extend_zeros(int64_t n) override;
  void set_length(int64_t n) override;
  bool can_truncate() const override { return tail_.numel() == 0; }  // a conv tail cannot go back
  void truncate(int64_t n) override;

  // Appends n tokens read from [n, H, hd] host views.
  void append(const HeadView& k, const HeadView& v, int64_t n);
  // The rows as [length, H, hd] for H = heads · group query heads (group > 1: grouped-query attention).
  HeadView keys(int64_t group = 1) { return {rows_.f32(0), heads_ * head_dim_, head_dim_, group}; }
  HeadView values(int64_t group = 1) { return {rows_.f32(1), heads_ * head_dim_, head_dim_, group}; }
  TokenRows& rows() { return rows_; }  // array 0 keys, 1 values
  Device device() const override { return rows_.device(); }
  int64_t max_tokens() const { return rows_.max_tokens(); }
  float* conv_tail() { return tail_.numel() ? tail_.f32() : nullptr; }  // [W−1, C], oldest first

 private:
  int64_t heads_, head_dim_, conv_channels_, conv_size_;
  TokenRows rows_;
  Tensor tail_;  // [conv_size − 1, conv_channels] or empty
};

// Softmax attention of B sequences of T new tokens continuing their KV caches, on the device where
// the caches live: qkv [B·T, (H + 2·Hkv)·hd] (q | k | v) appends its keys and values to each cache
// (of Hkv heads), then every query attends causally over its cache, query head h reading key/value
// head h / (H / Hkv) (grouped-query attention; Hkv = H for multi-head). Returns [B·T, H·hd]. Every
// cache takes its tokens, or (a cache full) none does. Inference only.
Tensor attend_cached(const Tensor& qkv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hd, float scale,
                     Memory* const* memories);

}  // namespace k3
