// The per-sequence memory of a delta-rule-family layer (linear attention, DeltaNet, Gated
// DeltaNet, KDA): the recurrent state S [HV, K, V] fp32 (+ the Katharopoulos normaliser sum
// z [HV, K] for normalised linear attention) and the short-conv tails, the last W−1 pre-conv
// inputs [W−1, C] of each convolved stream (q, k, v), on the device of the layer that made it.
// Fixed size: it does not grow with context. The pointers below are device pointers on CUDA.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "mixers/memory.h"

namespace k3 {

class RecurrentState final : public Memory {
 public:
  // conv_channels: channels of each convolved stream (empty or conv_size <= 1: no tails).
  RecurrentState(int64_t HV, int64_t K, int64_t V, bool normalizer, std::vector<int64_t> conv_channels,
                 int64_t conv_size, Device device = Device::CPU);
  MemoryKind kind() const override { return MemoryKind::RecurrentState; }
  void reset() override;
  std::unique_ptr<Memory> clone() const override;
  std::unique_ptr<Memory> clone_to(Device device) const override;
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return state_bytes() + conv_bytes(); }
  int64_t length() const override { return length_; }
  void extend_zeros(int64_t n) override { length_ += n; }
  void set_length(int64_t n) override;

  Device device() const override { return S_.device(); }
  size_t state_bytes() const { return S_.nbytes() + z_.nbytes(); }
  size_t conv_bytes() const;
  float* state() { return static_cast<float*>(S_.raw()); }  // [HV, K, V]
  float* normalizer() { return z_.numel() ? static_cast<float*>(z_.raw()) : nullptr; }  // [HV, K] or null
  float* conv_tail(size_t stream) { return static_cast<float*>(tails_.at(stream).raw()); }  // [W−1, C]
  int64_t tail_width(size_t stream) const { return tails_.at(stream).dim(1); }
  size_t streams() const { return tails_.size(); }
  int64_t conv_size() const { return conv_size_; }
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  int64_t HV_, K_, V_, conv_size_;
  std::vector<int64_t> channels_;
  Tensor S_, z_;
  std::vector<Tensor> tails_;
  int64_t length_ = 0;
};

}  // namespace k3
