// CUDA forms of the differentiable ops still wired per device (linear, embedding, RoPE, softmax
// attention, the MoE combine, cross-entropy) for Vars whose
// values live on the device (Tensor::to_device). Each of those ops' .cc dispatches here when its
// first input is a CUDA tensor (K3_AG_CUDA below). The other ops are wired once over kernels that
// dispatch on the tensors' device (elementwise.h, blocks.h, norm.h). fp32 values; kernels in
// ops_cuda.h.
//
// Under Recording each form keeps a backward closure that runs the backward kernels on the
// device and accumulates into the inputs' device gradients (Node::grad_cuda).
#pragma once

#include <optional>
#include <vector>

#include "ops/ag.h"
#include "ops/ag_heads.h"
#include "ops/ag_moe.h"
#include "ops/ag_norms.h"
#include "ops/precision.h"
#include "ops/situ.h"

namespace k3::ag::gpu {

bool on_cuda(const Var& x);

// Throws "[op] ..." when recording would need a backward through these inputs.
void forward_only(const char* op, const std::vector<Var>& inputs);
// A constant Var with a fresh CUDA tensor of `shape`.
Tensor empty(Shape shape);
// A zero-filled CUDA tensor of `shape` (scratch for backward kernels that overwrite), and the
// step that adds such a scratch gradient to x's device gradient (nothing when x needs none).
Tensor zeros(Shape shape);
void flush(const Var& x, const Tensor& g);
const float* in(const Var& x, const char* op);  // device pointer of a contiguous fp32 CUDA input

Var linear(const Var& x, const Var& w, const Var& b, WeightLayout layout);
// x · W_iᵀ for bias-free [out, in] weights of one dtype, in one grouped GEMM, no graph (inference).
std::vector<Tensor> linears_no_grad(const Tensor& x, const std::vector<const Tensor*>& weights);
Var embedding(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx);
Var position_embedding(const Var& table, const std::vector<int64_t>& positions);
Var causal_attention(const Var& q, const Var& k, const Var& v, int64_t B, int64_t T, int64_t H, float scale);
Var rope(const Var& x, const std::vector<int64_t>& positions, int64_t H, int64_t offset, const RopeTable& table);
Var weighted_combine(const std::vector<Var>& ys, const Dispatch& d, const Var& w, int64_t M);
// Mean next-token cross-entropy (ag::cross_entropy_head) in row chunks of [rows, V] logits on the
// device; the scalar comes back to the host. No z-loss on CUDA yet.
Var cross_entropy_head(const Var& h, const Var& w, const std::vector<int64_t>& targets, float z_loss);

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
