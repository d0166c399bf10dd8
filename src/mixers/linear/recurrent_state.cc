#include "mixers/linear/recurrent_state.h"

#include "core/error.h"

namespace k3 {

RecurrentState::RecurrentState(int64_t HV, int64_t K, int64_t V, bool normalizer, std::vector<int64_t> conv_channels,
                               int64_t conv_size, Device device)
    : HV_(HV), K_(K), V_(V), conv_size_(conv_size), channels_(std::move(conv_channels)) {
  S_ = Tensor::zeros_on(device, {HV, K, V});
  if (normalizer) z_ = Tensor::zeros_on(device, {HV, K});
  if (conv_size_ > 1)
    for (int64_t c : channels_) tails_.push_back(Tensor::zeros_on(device, {conv_size_ - 1, c}));
}

void RecurrentState::reset() {
  S_.zero();
  if (z_.numel()) z_.zero();
  for (Tensor& t : tails_) t.zero();
  length_ = 0;
}

std::unique_ptr<Memory> RecurrentState::clone() const {
  auto c = std::make_unique<RecurrentState>(*this);
  c->S_ = S_.clone();
  if (z_.numel()) c->z_ = z_.clone();
  for (Tensor& t : c->tails_) t = t.clone();
  return c;
}

std::unique_ptr<Memory> RecurrentState::clone_to(Device device) const {
  if (device == this->device()) return clone();
  auto c = std::make_unique<RecurrentState>(*this);
  c->S_ = S_.to_device(device);
  if (z_.numel()) c->z_ = z_.to_device(device);
  for (Tensor& t : c->tails_) t = t.to_device(device);
  return c;
}

void RecurrentState::restore(const Memory& snapshot) {
  const auto* s = dynamic_cast<const RecurrentState*>(&snapshot);
  K3_CHECK(s && s->HV_ == HV_ && s->K_ == K_ && s->V_ == V_ && s->conv_size_ == conv_size_ &&
               s->channels_ == channels_ && s->z_.numel() == z_.numel() && s->device() == device(),
           "RecurrentState::restore from a different layer's memory");
  S_.copy_from(s->S_);
  if (z_.numel()) z_.copy_from(s->z_);
  for (size_t i = 0; i < tails_.size(); ++i) tails_[i].copy_from(s->tails_[i]);
  length_ = s->length_;
}

void RecurrentState::set_length(int64_t n) {
  if (device() != Device::CUDA) Memory::set_length(n);
  length_ = n;
}

size_t RecurrentState::conv_bytes() const {
  size_t n = 0;
  for (const Tensor& t : tails_) n += t.nbytes();
  return n;
}

}  // namespace k3
