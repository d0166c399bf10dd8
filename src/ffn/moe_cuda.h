// The routed experts of a MoE on CUDA in one pass (inference): all routed rows gathered into one
// buffer in dispatch order, every active expert's gate and up GEMMs in one cuBLAS grouped call and
// the down GEMMs in another (cuda::gemm_nt_grouped), one activation over every row, one weighted
// scatter back to the tokens: a handful of launches per MoE layer instead of a small op chain per
// expert (ag::gather_rows, three linears, the GLU, weighted_combine), which dominated the decode
// step of small MoE models.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "ffn/glu.h"
#include "ops/ag_moe.h"

namespace k3::gpu {

// xr [M, width] and w [M, K] on the device; experts[d.experts[j]] run on d.rows_of(j). Returns
// Σ_k w[m, k] · expert_k(xr[m]) as [M, width] on the device.
Tensor moe_routed(const Tensor& xr, const ag::Dispatch& d, const Tensor& w, const std::vector<GluMlp>& experts,
                  int64_t M);

// moe.h's select_experts on device scores [M, E] (plus the selection bias [E] when defined): the
// [M·K] expert ids, in the host function's order, computed on the GPU (moe_route_cuda.cu).
std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group,
                                    int64_t topk_group);

}  // namespace k3::gpu
