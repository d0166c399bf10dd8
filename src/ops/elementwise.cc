#include "ops/elementwise.h"

#include <cmath>
#include <initializer_list>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/activation.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

namespace k3::elementwise {

namespace {
// Every defined tensor a contiguous fp32 array of n elements on `dev`.
Device check(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  if (!first.defined()) throw error(op, "missing input");
  const Device dev = first.device();
  const int64_t n = first.numel();
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (t->device() != dev)
      throw error(op, first.describe(), " is on ", device_words(dev), " but ", t->describe(), " is on ",
                  device_words(t->device()));
    if (t->dtype() != DType::F32 || !t->is_contiguous() || !t->has_storage())
      throw error(op, "needs contiguous fp32 tensors with values, got ", t->describe());
    if (t->numel() != n) throw error(op, "element counts differ: ", first.describe(), " vs ", t->describe());
  }
  return dev;
}

// f(i) for i in [0, n), split over the thread pool (the same values whatever the split).
template <class F>
void each(int64_t n, F f) {
  parallel_for(n, 1 << 15, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) f(i);
  });
}

#if defined(K3_HAS_CUDA)
cuda::Unary cuda_unary(Unary f) {
  switch (f) {
    case Unary::Scale: return cuda::Unary::Scale;
    case Unary::Sigmoid: return cuda::Unary::Sigmoid;
    case Unary::Silu: return cuda::Unary::Silu;
    case Unary::Elu1: return cuda::Unary::Elu1;
    case Unary::GeluTanh: break;
  }
  K3_CHECK(false, "no CUDA unary kernel for ", name(f));
  return cuda::Unary::Scale;
}
#endif
}  // namespace

const char* name(Unary f) {
  switch (f) {
    case Unary::Scale: return "scale";
    case Unary::Sigmoid: return "sigmoid";
    case Unary::Silu: return "silu";
    case Unary::Elu1: return "elu1";
    case Unary::GeluTanh: return "gelu";
  }
  return "?";
}

void unary(Unary f, const Tensor& x, const Tensor& y, float s) {
  const Device dev = check(name(f), {&x, &y});
  const int64_t n = x.numel();
  if (dev == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    if (f == Unary::GeluTanh) return cuda::gelu_tanh_forward(x.cuda_f32(), y.cuda_f32(), n, device::Storage::F32);
    return cuda::unary(x.cuda_f32(), y.cuda_f32(), n, cuda_unary(f), s);
#endif
  }
  const float* px = x.f32();
  float* py = y.f32();
  switch (f) {
    case Unary::Scale: return each(n, [&](int64_t i) { py[i] = px[i] * s; });
    case Unary::Sigmoid: return sigmoid_forward(px, py, n);
    case Unary::Silu: return silu_forward(px, py, n);
    case Unary::Elu1: return elu1_forward(px, py, n);
    case Unary::GeluTanh: return gelu_tanh_forward(px, py, n);
  }
}

void unary_backward(Unary f, const Tensor& x, const Tensor& dy, const Tensor& dx, float s) {
  const Device dev = check(name(f), {&x, &dy, &dx});
  const int64_t n = x.numel();
  if (dev == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    if (f != Unary::GeluTanh) return cuda::unary_backward(x.cuda_f32(), dy.cuda_f32(), dx.cuda_f32(), n, cuda_unary(f), s);
    // The GELU kernel writes its gradient: into scratch, then added.
    const Tensor g = Tensor::empty_on(Device::CUDA, x.shape());
    cuda::gelu_tanh_backward(x.cuda_f32(), dy.cuda_f32(), g.cuda_f32(), n, device::Storage::F32);
    return cuda::add_inplace(dx.cuda_f32(), g.cuda_f32(), n);
#endif
  }
  const float *px = x.f32(), *pg = dy.f32();
  float* pd = dx.f32();
  switch (f) {
    case Unary::Scale: return each(n, [&](int64_t i) { pd[i] += pg[i] * s; });
    case Unary::Sigmoid: return sigmoid_backward(px, pg, pd, n);
    case Unary::Silu: return silu_backward(px, pg, pd, n);
    case Unary::Elu1: return elu1_backward(px, pg, pd, n);
    case Unary::GeluTanh: return gelu_tanh_backward(px, pg, pd, n);
  }
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  if (check("add", {&a, &b, &y}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::binary(a.cuda_f32(), b.cuda_f32(), y.cuda_f32(), y.numel(), cuda::Binary::Add);
#endif
  }
  const float *pa = a.f32(), *pb = b.f32();
  float* py = y.f32();
  each(y.numel(), [&](int64_t i) { py[i] = pa[i] + pb[i]; });
}

void mul(const Tensor& a, const Tensor& b, const Tensor& y) {
  if (check("mul", {&a, &b, &y}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::binary(a.cuda_f32(), b.cuda_f32(), y.cuda_f32(), y.numel(), cuda::Binary::Mul);
#endif
  }
  const float *pa = a.f32(), *pb = b.f32();
  float* py = y.f32();
  each(y.numel(), [&](int64_t i) { py[i] = pa[i] * pb[i]; });
}

void accumulate(const Tensor& dx, const Tensor& dy) {
  if (check("accumulate", {&dx, &dy}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::add_inplace(dx.cuda_f32(), dy.cuda_f32(), dx.numel());
#endif
  }
  float* pd = dx.f32();
  const float* pg = dy.f32();
  each(dx.numel(), [&](int64_t i) { pd[i] += pg[i]; });
}

void mul_backward(const Tensor& a, const Tensor& b, const Tensor& dy, const Tensor& da, const Tensor& db) {
  if (check("mul", {&a, &b, &dy, &da, &db}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::mul_backward(a.cuda_f32(), b.cuda_f32(), dy.cuda_f32(), da.defined() ? da.cuda_f32() : nullptr,
                              db.defined() ? db.cuda_f32() : nullptr, dy.numel());
#endif
  }
  const float *pa = a.f32(), *pb = b.f32(), *pg = dy.f32();
  if (da.defined()) {
    float* d = da.f32();
    each(dy.numel(), [&](int64_t i) { d[i] += pg[i] * pb[i]; });
  }
  if (db.defined()) {
    float* d = db.f32();
    each(dy.numel(), [&](int64_t i) { d[i] += pg[i] * pa[i]; });
  }
}

}  // namespace k3::elementwise
