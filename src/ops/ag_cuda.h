// Helpers for the CUDA forms of differentiable ops that live with their mechanism (the delta rule
// in mixers/linear/ag_delta_cuda.cc, Attention Residuals in residual/ag_attnres_cuda.cc): the op's
// body hands the call to its CUDA form when its first input lives on the device (K3_AG_CUDA).
// Under Recording a CUDA form keeps a backward closure that runs the backward kernels on the
// device and accumulates into the inputs' device gradients (Node::grad_cuda). The ops of ops/
// dispatch on the tensor's device inside one wiring instead.
#pragma once

#include <vector>

#include "ops/ag.h"
#include "ops/precision.h"

namespace k3::ag::gpu {

bool on_cuda(const Var& x);

// Throws "[op] ..." when recording would need a backward through these inputs.
void forward_only(const char* op, const std::vector<Var>& inputs);
// A fresh CUDA tensor of `shape`.
Tensor empty(Shape shape);
// A zero-filled CUDA tensor of `shape` (scratch for backward kernels that overwrite), and the
// step that adds such a scratch gradient to x's device gradient (nothing when x needs none).
Tensor zeros(Shape shape);
void flush(const Var& x, const Tensor& g);
const float* in(const Var& x, const char* op);  // device pointer of a contiguous fp32 CUDA input

}  // namespace k3::ag::gpu

// In an op's CPU body: hands the call to its CUDA form when `x` lives on the device.
#if defined(K3_HAS_CUDA)
#define K3_AG_CUDA(x, call)                             \
  do {                                                  \
    if (::k3::ag::gpu::on_cuda(x)) return ::k3::ag::gpu::call; \
  } while (0)
#else
#define K3_AG_CUDA(x, call) \
  do {                      \
  } while (0)
#endif
