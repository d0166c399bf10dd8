// Tensor: a typed, strided view of memory plus a shared owner that keeps the memory alive.
// The owner may be heap storage, an mmap'd checkpoint (zero-copy) or an arena block. A tensor
// without storage ("meta") carries only a shape: models built that way count parameters and
// bytes without allocating (k3 info on a 2.8T-parameter config).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace k3 {

enum class Device : uint8_t { CPU, CUDA };
// "the host" or "the GPU", for messages about where tensors live.
const char* device_words(Device d);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  // Fresh, owned, 64-byte-aligned storage. `empty` leaves it uninitialised.
  static Tensor empty(Shape shape, DType dtype = DType::F32);
  // Fresh storage on `device` (CUDA: from the caching allocator of core/device.h).
  static Tensor empty_on(Device device, Shape shape, DType dtype = DType::F32);
  static Tensor zeros(Shape shape, DType dtype = DType::F32);
  static Tensor zeros_on(Device device, Shape shape, DType dtype = DType::F32);
  static Tensor full(Shape shape, float value);
  // A view of external memory kept alive by `owner` (for example an mmap'd file).
  static Tensor external(void* data, Shape shape, DType dtype, std::shared_ptr<void> owner);
  // Shape and dtype only, no storage.
  static Tensor meta(Shape shape, DType dtype = DType::F32);
  static Tensor from_vector(const std::vector<float>& v, Shape shape);

  bool defined() const { return !shape_.empty() || data_ != nullptr || numel_ == 1; }
  bool has_storage() const { return data_ != nullptr || numel_ == 0; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return int(shape_.size()); }
  int64_t dim(int i) const;  // negative counts from the end
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return dtype_bytes(dtype_, numel_); }  // a block format's codes and scales
  bool is_contiguous() const;

  void* raw() const { return data_; }
  template <class T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  float* f32() const;       // checks dtype == F32, storage present and on the host
  float* cuda_f32() const;  // the same for a tensor on the CUDA device (a device pointer)

  // Views (share storage).
  Tensor reshape(Shape shape) const;            // contiguous tensors only; one dim may be -1
  Tensor slice(int dim, int64_t begin, int64_t end) const;  // [begin, end) along dim
  Tensor select(int dim, int64_t index) const;  // drops dim

  // Copies.
  Tensor clone() const;                  // contiguous copy, same dtype
  Tensor to(DType dtype) const;          // contiguous copy converted (float types)
  void copy_from(const Tensor& src);     // same shape; converts dtype (on the host; on CUDA same dtype)
  void zero();                           // contiguous tensors, either device
  void fill(float value);                // F32 only
  // A contiguous copy on `device`, same dtype; a tensor already there is returned as it is (a
  // view, possibly strided). A copy to the host waits for the device.
  Tensor to_device(Device device) const;

  std::string describe() const;  // "F32[2, 3]", "cuda:F32[2, 3]"

 private:
  void* data_ = nullptr;
  std::shared_ptr<void> owner_;
  Shape shape_;
  Shape strides_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;

  static Shape contiguous_strides(const Shape& s);
};

// Throws k3::Error naming `what` if t's shape differs from `expected` (-1 matches anything).
void expect_shape(const Tensor& t, const Shape& expected, const std::string& what);

}  // namespace k3
