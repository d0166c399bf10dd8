// The routed experts of a MoE on CUDA in one pass (inference): all routed rows gathered into one
// buffer in dispatch order, every active expert's gate and up GEMMs in one cuBLAS grouped call and
// the down GEMMs in another (cuda::gemm_nt_grouped), one activation over every row, one weighted
// scatter back to the tokens: a handful of launches per MoE layer instead of a small op chain per
// expert (ag::gather_rows, three linears, the GLU, weighted_combine), which dominated the decode
// step of small MoE models.
#pragma once

#include <vector>

#include "core/device.h"
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

// The decode's sync-free form, for small batches (every expert would run anyway): the ids stay on
// the device, every expert runs on every row, and the routing weights pick what each row keeps.
// select_experts_on_device: the [M·K] ids (int64) as select_experts computes them, not downloaded.
device::Buffer select_experts_on_device(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group,
                                        int64_t topk_group);
// w [M, K] = scores at the ids (+ offset[id] when defined), renormalised over k (÷ (Σ + eps)) when
// renorm, times scaling; dense [M, E] holds them in their experts' columns, zeros elsewhere.
void dense_weights(const Tensor& scores, const device::Buffer& idx, const Tensor& offset, int64_t K, bool renorm,
                   float eps, float scaling, Tensor& w, Tensor& dense);
// out[m, :] = Σ_e dense[m, e] · y[e, m, :] (y [E, M, C] on the device).
void dense_combine(const float* y, const Tensor& dense, int64_t C, float* out);
// Every expert on every row of xr [M, width], combined by dense [M, E]: [M, width].
Tensor moe_dense(const Tensor& xr, const Tensor& dense, const std::vector<GluMlp>& experts);

}  // namespace k3::gpu
