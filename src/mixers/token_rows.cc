#include "mixers/token_rows.h"

#include <algorithm>
#include <cstring>

#include "core/device.h"
#include "core/error.h"

namespace k3 {

TokenRows::TokenRows(std::string who, std::vector<int64_t> widths, int64_t max_tokens, Device device, DType dtype)
    : who_(std::move(who)), widths_(std::move(widths)), max_(max_tokens), device_(device), dtype_(dtype) {
  K3_CHECK(max_tokens >= 0, who_, ": negative token limit ", max_tokens);
  K3_CHECK(dtype == DType::F32 || (dtype == DType::BF16 && device == Device::CUDA), who_, ": ", dtype_name(dtype),
           " rows are kept on CUDA only");
  if (device == Device::CUDA) {
    for (int64_t w : widths_) arrays_.push_back(Tensor::empty_on(device, {max_tokens, w}, dtype));
    capacity_ = max_tokens;
  } else {
    for (int64_t w : widths_) arrays_.push_back(Tensor::empty({0, w}, dtype));
  }
}

void TokenRows::grow(int64_t need) {
  int64_t cap = std::max<int64_t>(capacity_, 16);
  while (cap < need) cap *= 2;
  cap = std::min(cap, max_);
  for (size_t i = 0; i < arrays_.size(); ++i) {
    Tensor a = Tensor::empty({cap, widths_[i]}, dtype_);
    if (length_) std::memcpy(a.raw(), arrays_[i].raw(), size_t(length_ * widths_[i]) * dtype_size(dtype_));
    arrays_[i] = std::move(a);
  }
  capacity_ = cap;
}

void TokenRows::reserve(int64_t n) {
  if (length_ + n > max_)
    throw error(who_, "context of ", length_ + n, " tokens exceeds the limit of ", max_, " positions");
  if (length_ + n > capacity_) grow(length_ + n);  // the host only: CUDA rows are allocated up front
}

void TokenRows::set_length(int64_t n) {
  if (n < 0 || n > capacity_) throw error(who_, "length ", n, " outside the ", capacity_, " rows allocated");
  length_ = n;
}

void TokenRows::truncate(int64_t n) {
  if (n < 0 || n > length_) throw error(who_, "truncate to ", n, " tokens of ", length_);
  length_ = n;
}

void TokenRows::extend_zeros(int64_t n) {
  reserve(n);
  for (size_t i = 0; i < arrays_.size() && n; ++i) {
    const size_t row = size_t(widths_[i]) * dtype_size(dtype_);
    char* at = static_cast<char*>(arrays_[i].raw()) + size_t(length_) * row;
    if (device_ == Device::CUDA)
      device::zero(at, size_t(n) * row);
    else
      std::memset(at, 0, size_t(n) * row);
  }
  length_ += n;
}

void TokenRows::append(size_t i, const float* src, int64_t ld, int64_t n) {
  K3_CHECK(dtype_ == DType::F32, who_, ": fp32 rows appended to ", dtype_name(dtype_), " rows");
  K3_CHECK(length_ + n <= capacity_, who_, ": append of ", n, " rows without reserve");
  const int64_t w = widths_[i];
  float* dst = f32(i) + length_ * w;
  if (device_ == Device::CUDA) {
    device::copy_rows(dst, size_t(w) * 4, src, size_t(ld) * 4, size_t(w) * 4, size_t(n));
    return;
  }
  for (int64_t t = 0; t < n; ++t) std::memcpy(dst + t * w, src + t * ld, size_t(w) * 4);
}

TokenRows TokenRows::clone() const {
  TokenRows c = *this;
  for (Tensor& a : c.arrays_) a = a.clone();
  return c;
}

TokenRows TokenRows::clone_to(Device device) const {
  if (device == device_) return clone();
  TokenRows c = *this;
  c.device_ = device;
  c.capacity_ = device == Device::CUDA ? max_ : length_;
  for (size_t i = 0; i < arrays_.size(); ++i) {
    c.arrays_[i] = Tensor::empty_on(device, {c.capacity_, widths_[i]}, dtype_);
    const size_t n = size_t(length_ * widths_[i]) * dtype_size(dtype_);
    if (n == 0) continue;
    if (device == Device::CUDA)
      device::upload(c.arrays_[i].raw(), arrays_[i].raw(), n);
    else
      device::download(c.arrays_[i].raw(), arrays_[i].raw(), n);
  }
  if (device == Device::CPU) device::synchronize();
  return c;
}

void TokenRows::restore(const TokenRows& s) {
  K3_CHECK(s.widths_ == widths_ && s.dtype_ == dtype_ && s.device_ == device_, who_,
           ": restore from a different layer's memory");
  if (s.length_ > capacity_) grow(s.length_);
  for (size_t i = 0; i < arrays_.size() && s.length_; ++i) {
    const size_t n = size_t(s.length_ * widths_[i]) * dtype_size(dtype_);
    if (device_ == Device::CUDA)
      device::copy(arrays_[i].raw(), s.arrays_[i].raw(), n);
    else
      std::memcpy(arrays_[i].raw(), s.arrays_[i].raw(), n);
  }
  length_ = s.length_;
}

size_t TokenRows::bytes() const {
  size_t b = 0;
  for (const Tensor& a : arrays_) b += a.nbytes();
  return b;
}

float* TokenRows::f32(size_t i) const {
  K3_CHECK(dtype_ == DType::F32, who_, ": fp32 rows asked of ", dtype_name(dtype_), " rows");
  return static_cast<float*>(arrays_[i].raw());
}

}  // namespace k3
