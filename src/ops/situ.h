// GLU activations for gated MLPs: SiLU-GLU (DeepSeek-V3, Kimi Linear) and SiTU (Kimi K3, spec §9).
//
//   SiTU(gate, up) = [β·tanh(gate/β)·σ(gate)] · [β_lin·tanh(up/β_lin)],  β = 4, β_lin = 25
//
// The first factor is a soft-capped SiLU (range (−0.270, β)), the second soft-caps the linear
// branch to ±β_lin. Either cap may be absent: no β gives plain SiLU(gate), no β_lin the plain up
// (spec §9: "If β_lin is null, the up branch is left unchanged"). Evaluated in fp32.
#pragma once

#include <optional>

#include "ops/autograd.h"

namespace k3 {

struct SituOptions {
  std::optional<float> beta = 4.0f;       // activation_situ_beta; nullopt: plain SiLU(gate)
  std::optional<float> beta_lin = 25.0f;  // activation_situ_linear_beta; nullopt: plain up

  static SituOptions silu() { return SituOptions{std::nullopt, std::nullopt}; }
};

// Scalar factors and their derivatives (exposed for tests and fused kernels elsewhere).
float situ_gate(float gate, std::optional<float> beta);         // β·tanh(g/β)·σ(g) or SiLU(g)
float situ_gate_grad(float gate, std::optional<float> beta);    // d/dg of the above
float situ_up(float up, std::optional<float> beta_lin);         // β_lin·tanh(u/β_lin) or u
float situ_up_grad(float up, std::optional<float> beta_lin);    // d/du of the above

namespace ag {

// Elementwise situ_gate(gate) · situ_up(up); gate and up have the same shape. One fused node:
// the backward recomputes the factors from the saved inputs (no intermediate tensors kept).
Var situ_glu(const Var& gate, const Var& up, const SituOptions& opts);
// SiLU(gate) · up (SiTU with both caps absent).
Var silu_glu(const Var& gate, const Var& up);

}  // namespace ag
}  // namespace k3
