// The per-sequence memory of a delta-rule-family layer (linear attention, DeltaNet, Gated
// DeltaNet, KDA): the recurrent state S [HV, K, V] fp32 (+ the Katharopoulos normaliser sum
// z [HV, K] for normalised linear attention) and the short-conv tails, the last W−1 pre-conv
// inputs [W−1, C] of each convolved stream (q, k, v). Fixed size: it does not grow with context.
#pragma once

#include <vector>

#include "mixers/memory.h"

namespace k3 {

class RecurrentState final : public Memory {
 public:
  // conv_channels: channels of each convolved stream (empty or conv_size <= 1: no tails).
  RecurrentState(int64_t HV, int64_t K, int64_t V, bool normalizer, std::vector<int64_t> conv_channels,
                 int64_t conv_size);
  MemoryKind kind() const override { return MemoryKind::RecurrentState; }
  void reset() override;
  std::unique_ptr<Memory> clone() const override { return std::make_unique<RecurrentState>(*this); }
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return state_bytes() + conv_bytes(); }
  int64_t length() const override { return length_; }
  void extend_zeros(int64_t n) override { length_ += n; }

  size_t state_bytes() const { return (S_.size() + z_.size()) * sizeof(float); }
  size_t conv_bytes() const;
  float* state() { return S_.data(); }            // [HV, K, V]
  float* normalizer() { return z_.empty() ? nullptr : z_.data(); }  // [HV, K] or null
  float* conv_tail(size_t stream) { return tails_[stream].data(); }  // [W−1, C]
  size_t streams() const { return tails_.size(); }
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  int64_t HV_, K_, V_, conv_size_;
  std::vector<int64_t> channels_;
  std::vector<float> S_, z_;
  std::vector<std::vector<float>> tails_;
  int64_t length_ = 0;
};

}  // namespace k3
