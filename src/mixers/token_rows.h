// Per-token rows of one or more arrays ([capacity, width_i], one dtype) on a device: the storage of
// the KV and latent caches. On the host the capacity grows geometrically as tokens arrive; on CUDA
// it is allocated for max_tokens up front, so a replayed decode graph finds its rows where it left
// them. length() rows are valid; the rest is scratch.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace k3 {

class TokenRows {
 public:
  TokenRows(std::string who, std::vector<int64_t> widths, int64_t max_tokens, Device device, DType dtype = DType::F32);

  // Throws "[who] context of N tokens exceeds ..." unless n more tokens fit; else makes room.
  void reserve(int64_t n);
  void advance(int64_t n) { length_ += n; }
  void set_length(int64_t n);  // within the allocated rows
  void truncate(int64_t n);    // back to the first n rows (n <= length)
  void reset() { length_ = 0; }
  void extend_zeros(int64_t n);  // n zero rows in every array
  // Appends n rows to array i from rows of fp32 values with leading dimension ld (on the rows'
  // device); call advance after.
  void append(size_t i, const float* src, int64_t ld, int64_t n);
  // A deep copy; and copying a copy's rows back (same widths, dtype and device).
  TokenRows clone() const;
  void restore(const TokenRows& s);
  // A deep copy on `device`: on the host it holds the length() valid rows alone (also bf16 rows, as
  // storage to copy back), on CUDA max_tokens rows as ever.
  TokenRows clone_to(Device device) const;

  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }  // rows allocated now
  int64_t max_tokens() const { return max_; }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }
  size_t arrays() const { return widths_.size(); }
  int64_t width(size_t i) const { return widths_[i]; }
  size_t bytes() const;
  void* raw(size_t i) { return arrays_[i].raw(); }
  const void* raw(size_t i) const { return arrays_[i].raw(); }
  float* f32(size_t i) const;  // fp32 rows (a device pointer on CUDA)

 private:
  void grow(int64_t need);
  std::string who_;
  std::vector<int64_t> widths_;
  int64_t max_, capacity_ = 0, length_ = 0;
  Device device_;
  DType dtype_;
  std::vector<Tensor> arrays_;  // [capacity, width_i]
};

}  // namespace k3
