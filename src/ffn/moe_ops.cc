#include "ffn/moe_ops.h"

#include "ffn/moe.h"
#include "ffn/moe_cuda.h"

namespace k3::moe {

std::vector<int64_t> select(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group, int64_t topk_group) {
  if (scores.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) return gpu::select_experts(scores, bias, K, n_group, topk_group);
  }
  const Tensor s = scores.to_device(Device::CPU);
  const int64_t M = s.dim(0), E = s.dim(1);
  if (!bias.defined()) return select_experts(s.f32(), M, E, K, n_group, topk_group);
  // s' = s + b, used for selection only (spec §8.1 steps 2–5).
  std::vector<float> choice(static_cast<size_t>(M * E));
  const Tensor b = bias.to_device(Device::CPU);
  const float *ps = s.f32(), *pb = b.f32();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t e = 0; e < E; ++e) choice[size_t(m * E + e)] = ps[m * E + e] + pb[e];
  return select_experts(choice.data(), M, E, K, n_group, topk_group);
}

bool has_dense_form(const Tensor& x) { return device::kCudaBuilt && x.device() == Device::CUDA; }

DenseRouting dense_routing(const Tensor& scores, const Tensor& bias, const Tensor& offset, int64_t K, int64_t n_group,
                           int64_t topk_group, bool renormalize, float renorm_eps, float scaling) {
  DenseRouting r;
  if constexpr (device::kCudaBuilt) {
    r.ids = gpu::select_experts_on_device(scores, bias, K, n_group, topk_group);
    gpu::dense_weights(scores, r.ids, offset, K, renormalize, renorm_eps, scaling, r.weights, r.dense);
  } else {
    device::require_cuda("moe");
  }
  return r;
}

Tensor dense_experts(const Tensor& xr, const Tensor& dense, const std::vector<GluMlp>& experts) {
  if constexpr (device::kCudaBuilt) return gpu::moe_dense(xr, dense, experts);
  device::require_cuda("moe");
  return {};
}

std::optional<Tensor> routed_experts(const Tensor& xr, const ag::Dispatch& d, const Tensor& w,
                                     const std::vector<GluMlp>& experts, int64_t M) {
  // Block-format experts (core/quant.h) go expert by expert, through the linear layer's packed forms.
  if (xr.device() == Device::CUDA && !is_block_dtype(experts.at(0).gate.weight->value.dtype())) {
    if constexpr (device::kCudaBuilt) return gpu::moe_routed(xr, d, w, experts, M);
  }
  return std::nullopt;
}

}  // namespace k3::moe
