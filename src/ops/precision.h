// The precision of GEMM operands while a Bf16Gemms scope is alive on this thread (mixed-precision
// training, `k3 train --dtype bf16`): fp32 weights and activations are rounded to bf16 as GEMM
// operands (both in the forward and in the backward's dX / dW products), products accumulate in
// fp32 and the gradients and master weights stay fp32. Causal attention's operands (q, k, v, y,
// dy) are bf16 in the scope too: its two products are GEMMs, run on the tensor cores. Every other
// op keeps fp32 (PyTorch autocast's split). The CUDA forms honour it; the CPU computes
// in fp32 whatever the scope says.
#pragma once

namespace k3::ag::gpu {

class Bf16Gemms {
 public:
  Bf16Gemms();
  ~Bf16Gemms();
  Bf16Gemms(const Bf16Gemms&) = delete;
  Bf16Gemms& operator=(const Bf16Gemms&) = delete;

 private:
  bool saved_;
};
bool bf16_gemms();
void set_bf16_gemms(bool on);

}  // namespace k3::ag::gpu
