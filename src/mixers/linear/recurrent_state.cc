#include "mixers/linear/recurrent_state.h"

#include <algorithm>

#include "core/error.h"

namespace k3 {

RecurrentState::RecurrentState(int64_t HV, int64_t K, int64_t V, bool normalizer, std::vector<int64_t> conv_channels,
                               int64_t conv_size)
    : HV_(HV), K_(K), V_(V), conv_size_(conv_size), channels_(std::move(conv_channels)) {
  S_.assign(static_cast<size_t>(HV * K * V), 0.0f);
  if (normalizer) z_.assign(static_cast<size_t>(HV * K), 0.0f);
  if (conv_size_ > 1)
    for (int64_t c : channels_) tails_.emplace_back(static_cast<size_t>((conv_size_ - 1) * c), 0.0f);
}

void RecurrentState::reset() {
  std::fill(S_.begin(), S_.end(), 0.0f);
  std::fill(z_.begin(), z_.end(), 0.0f);
  for (auto& t : tails_) std::fill(t.begin(), t.end(), 0.0f);
  length_ = 0;
}

void RecurrentState::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const RecurrentState*>(&snapshot);
  K3_CHECK(s && s->HV_ == HV_ && s->K_ == K_ && s->V_ == V_ && s->conv_size_ == conv_size_ &&
               s->channels_ == channels_ && s->z_.size() == z_.size(),
           "RecurrentState::restore from a different layer's memory");
  *this = *s;
}

size_t RecurrentState::conv_bytes() const {
  size_t n = 0;
  for (const auto& t : tails_) n += t.size();
  return n * sizeof(float);
}

}  // namespace k3
