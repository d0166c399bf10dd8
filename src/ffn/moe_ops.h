// The MoE layer's routing and expert ops, on the device where their tensors live. Each has a host
// form, or says it has none (the layer then composes the per-expert ops of ops/ag_moe.h, whose
// forms on both devices have a backward).
#pragma once

#include <optional>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ffn/glu.h"
#include "ops/ag_moe.h"

namespace k3::moe {

// Top-K expert ids [M·K] for scores [M, E], selecting on scores + bias (bias [E] when defined) by
// the grouped rule of select_experts (moe.h); the ids come back to the host.
std::vector<int64_t> select(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group, int64_t topk_group);

// Inference over every expert for every row, for small batches: the ids stay where the scores are.
// Only CUDA has this form.
bool has_dense_form(const Tensor& x);
struct DenseRouting {
  device::Buffer ids;  // [M·K] int64, on the device
  Tensor weights;      // [M, K] combine weights
  Tensor dense;        // [M, E] the same weights scattered over all experts
};
DenseRouting dense_routing(const Tensor& scores, const Tensor& bias, const Tensor& offset, int64_t K, int64_t n_group,
                           int64_t topk_group, bool renormalize, float renorm_eps, float scaling);
Tensor dense_experts(const Tensor& xr, const Tensor& dense, const std::vector<GluMlp>& experts);

// Every routed expert on its rows and the weighted combine in one pass, for inference; nullopt
// where there is no such form (the host, block-format experts).
std::optional<Tensor> routed_experts(const Tensor& xr, const ag::Dispatch& d, const Tensor& w,
                                     const std::vector<GluMlp>& experts, int64_t M);

}  // namespace k3::moe
