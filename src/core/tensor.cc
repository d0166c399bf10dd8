#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/device.h"
#include "core/quant.h"

namespace k3 {

const char* device_words(Device d) { return d == Device::CUDA ? "the GPU" : "the host"; }


std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape Tensor::contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

namespace {
void check_shape(const Shape& shape, DType dtype) {
  for (int64_t d : shape)
    if (d < 0) throw error("tensor", "negative dimension in shape ", shape_str(shape));
  if (is_block_dtype(dtype) && (shape.empty() || shape.back() % dtype_block(dtype) != 0))
    throw error("tensor", dtype_name(dtype), shape_str(shape), ": rows of ", dtype_name(dtype), " are whole blocks of ",
                dtype_block(dtype), " values");
}
}  // namespace

Tensor Tensor::empty(Shape shape, DType dtype) {
  check_shape(shape, dtype);
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  size_t bytes = t.nbytes();
  if (bytes > 0) {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw error("tensor", "out of memory allocating ", bytes, " bytes for ", t.describe());
    t.owner_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    t.data_ = p;
  }
  return t;
}

Tensor Tensor::empty_on(Device device, Shape shape, DType dtype) {
  if (device == Device::CPU) return empty(std::move(shape), dtype);
  check_shape(shape, dtype);
  Tensor t = meta(std::move(shape), dtype);
  t.device_ = Device::CUDA;
  if (t.nbytes() > 0) {
    auto buf = std::make_shared<device::Buffer>(t.nbytes());
    t.data_ = buf->get();
    t.owner_ = std::move(buf);
  }
  return t;
}

Tensor Tensor::zeros_on(Device device, Shape shape, DType dtype) {
  Tensor t = empty_on(device, std::move(shape), dtype);
  t.zero();
  return t;
}

void Tensor::zero() {
  K3_CHECK(is_contiguous(), "zero of a non-contiguous tensor ", describe());
  if (!numel_) return;
  if (device_ == Device::CUDA)
    device::zero(data_, nbytes());
  else
    std::memset(data_, 0, nbytes());
}

Tensor Tensor::to_device(Device device) const {
  if (device == device_) return *this;
  K3_CHECK(has_storage(), "to_device of a tensor without storage: ", describe());
  if (device == Device::CUDA) {
    const Tensor c = is_contiguous() ? *this : clone();
    Tensor t = empty_on(Device::CUDA, shape_, dtype_);
    if (numel_) device::upload(t.data_, c.data_, nbytes());
    return t;
  }
  K3_CHECK(is_contiguous(), "copy of a non-contiguous CUDA tensor to the host: ", describe());
  Tensor t = empty(shape_, dtype_);
  if (numel_) {
    device::download(t.data_, data_, nbytes());
    device::synchronize();
  }
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  if (t.data_) std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::full(Shape shape, float value) {
  Tensor t = empty(std::move(shape), DType::F32);
  t.fill(value);
  return t;
}

Tensor Tensor::external(void* data, Shape shape, DType dtype, std::shared_ptr<void> owner) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.data_ = data;
  t.owner_ = std::move(owner);
  return t;
}

Tensor Tensor::meta(Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& v, Shape shape) {
  if (shape_numel(shape) != int64_t(v.size()))
    throw error("tensor", "from_vector: ", v.size(), " values do not fill shape ", shape_str(shape));
  Tensor t = empty(std::move(shape));
  if (!v.empty()) std::memcpy(t.data_, v.data(), v.size() * 4);
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  K3_CHECK(i >= 0 && i < n, "dim ", i, " out of range for ", describe());
  return shape_[size_t(i)];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

float* Tensor::f32() const {
  K3_CHECK(dtype_ == DType::F32, "expected F32 tensor, got ", describe());
  K3_CHECK(data_ != nullptr || numel_ == 0, "tensor has no storage: ", describe());
  K3_CHECK(device_ == Device::CPU, "host read of ", describe(), ": this operation has no CUDA form yet");
  return static_cast<float*>(data_);
}

float* Tensor::cuda_f32() const {
  K3_CHECK(dtype_ == DType::F32, "expected F32 tensor, got ", describe());
  K3_CHECK(data_ != nullptr || numel_ == 0, "tensor has no storage: ", describe());
  K3_CHECK(device_ == Device::CUDA, "expected a CUDA tensor, got ", describe());
  return static_cast<float*>(data_);
}

Tensor Tensor::reshape(Shape shape) const {
  K3_CHECK(is_contiguous(), "reshape of a non-contiguous tensor ", describe());
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      K3_CHECK(infer < 0, "reshape: more than one -1");
      infer = int(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) shape[size_t(infer)] = known ? numel_ / known : 0;
  K3_CHECK(shape_numel(shape) == numel_, "reshape ", describe(), " to ", shape_str(shape));
  check_shape(shape, dtype_);
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.strides_ = contiguous_strides(t.shape_);
  return t;
}

Tensor Tensor::slice(int d, int64_t begin, int64_t end) const {
  if (d < 0) d += ndim();
  K3_CHECK(d >= 0 && d < ndim() && begin >= 0 && begin <= end && end <= shape_[size_t(d)],
           "slice(", d, ", ", begin, ", ", end, ") of ", describe());
  K3_CHECK(!is_block_dtype(dtype_), "slice of ", describe(), ": a block format keeps its scales apart from its codes");
  Tensor t = *this;
  if (data_) t.data_ = static_cast<char*>(data_) + begin * strides_[size_t(d)] * int64_t(dtype_size(dtype_));
  t.shape_[size_t(d)] = end - begin;
  t.numel_ = shape_numel(t.shape_);
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  if (d < 0) d += ndim();
  Tensor t = slice(d, index, index + 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

namespace {
// Calls fn(offset_in_elements) for every element of a strided tensor, in row-major order.
template <class F>
void for_each_offset(const Shape& shape, const Shape& strides, F&& fn) {
  size_t n = shape.size();
  int64_t total = shape_numel(shape);
  if (total == 0) return;
  std::vector<int64_t> idx(n, 0);
  int64_t off = 0;
  for (int64_t k = 0; k < total; ++k) {
    fn(off);
    for (size_t i = n; i-- > 0;) {
      if (++idx[i] < shape[i]) {
        off += strides[i];
        break;
      }
      off -= strides[i] * (shape[i] - 1);
      idx[i] = 0;
    }
  }
}
}  // namespace

Tensor Tensor::clone() const {
  K3_CHECK(has_storage(), "clone of a tensor without storage");
  if (device_ == Device::CUDA) {
    K3_CHECK(is_contiguous(), "clone of a non-contiguous CUDA tensor ", describe());
    Tensor t = empty_on(Device::CUDA, shape_, dtype_);
    if (numel_) device::copy(t.data_, data_, nbytes());
    return t;
  }
  Tensor t = empty(shape_, dtype_);
  size_t es = dtype_size(dtype_);
  if (is_contiguous()) {
    if (numel_) std::memcpy(t.data_, data_, nbytes());
    return t;
  }
  char* dst = static_cast<char*>(t.data_);
  const char* src = static_cast<const char*>(data_);
  for_each_offset(shape_, strides_, [&](int64_t off) {
    std::memcpy(dst, src + off * int64_t(es), es);
    dst += es;
  });
  return t;
}

Tensor Tensor::to(DType dtype) const {
  K3_CHECK(device_ == Device::CPU || dtype == dtype_, "dtype conversion of ", describe(), " on the device");
  Tensor c = is_contiguous() ? *this : clone();
  if (dtype == dtype_) return c.clone();
  Tensor t = empty(shape_, dtype);
  if (is_block_dtype(dtype)) {  // quantised by rows, so that F8B128's tiles are 128 rows tall
    const Tensor f = dtype_ == DType::F32 ? c : c.to(DType::F32);
    const int64_t cols = shape_.empty() ? 1 : shape_.back();
    quantize_blocks(dtype, static_cast<const float*>(f.data_), cols ? numel_ / cols : 0, cols, t.data_);
  } else if (dtype == DType::F32) {
    convert_to_f32(dtype_, c.data_, static_cast<float*>(t.data_), size_t(numel_));
  } else if (dtype_ == DType::F32) {
    convert_from_f32(dtype, static_cast<const float*>(c.data_), t.data_, size_t(numel_));
  } else {
    Tensor f = c.to(DType::F32);
    convert_from_f32(dtype, static_cast<const float*>(f.data_), t.data_, size_t(numel_));
  }
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  K3_CHECK(src.shape_ == shape_, "copy_from: shape ", src.describe(), " into ", describe());
  if (device_ == Device::CUDA && src.device_ == Device::CUDA) {
    K3_CHECK(src.dtype_ == dtype_ && is_contiguous() && src.is_contiguous(), "copy_from on CUDA: ", src.describe(),
             " into ", describe(), " (same dtype, contiguous)");
    if (numel_) device::copy(data_, src.data_, nbytes());
    return;
  }
  K3_CHECK(device_ == Device::CPU && src.device_ == Device::CPU, "copy_from between devices: ", src.describe(),
           " into ", describe(), " (use to_device)");
  K3_CHECK(is_contiguous(), "copy_from into a non-contiguous tensor");
  Tensor c = src.dtype_ == dtype_ ? (src.is_contiguous() ? src : src.clone()) : src.to(dtype_);
  if (numel_) std::memcpy(data_, c.data_, nbytes());
}

void Tensor::fill(float value) {
  float* p = f32();
  K3_CHECK(is_contiguous(), "fill of a non-contiguous tensor");
  for (int64_t i = 0; i < numel_; ++i) p[i] = value;
}

std::string Tensor::describe() const {
  return std::string(device_ == Device::CUDA ? "cuda:" : "") + std::string(dtype_name(dtype_)) + shape_str(shape_);
}

void expect_shape(const Tensor& t, const Shape& expected, const std::string& what) {
  bool ok = t.ndim() == int(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i)
    ok = expected[i] < 0 || expected[i] == t.shape()[i];
  if (!ok)
    throw error("shape", what, " has shape ", shape_str(t.shape()), ", expected ", shape_str(expected));
}

}  // namespace k3
