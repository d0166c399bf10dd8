#include "ops/ag_cuda.h"

#include "core/device.h"
#include "ops/ops_cuda.h"

namespace k3::ag::gpu {

bool on_cuda(const Var& x) { return x && x->value.device() == Device::CUDA; }

void forward_only(const char* op, const std::vector<Var>& inputs) {
  if (!recording()) return;
  for (const Var& v : inputs)
    if (needs_grad(v))
      throw error(op, "training through this op on CUDA is not supported yet (its CUDA form is forward-only)");
}

Tensor empty(Shape shape) { return Tensor::empty_on(Device::CUDA, std::move(shape)); }

Tensor zeros(Shape shape) { return Tensor::zeros_on(Device::CUDA, std::move(shape)); }

void flush(const Var& x, const Tensor& g) {
  if (x && needs_grad(x)) cuda::add_inplace(x->grad_cuda(), g.cuda_f32(), g.numel());
}

const float* in(const Var& x, const char* op) {
  if (!x) throw error(op, "missing input");
  if (x->value.device() != Device::CUDA)
    throw error(op, "input ", x->value.describe(), " is on the host while the op runs on CUDA");
  if (!x->value.is_contiguous()) throw error(op, "non-contiguous CUDA input ", x->value.describe());
  return x->value.cuda_f32();
}

}  // namespace k3::ag::gpu
