// Per-head normalisations of the delta-rule family (spec §3, §5.3; oracles.md §1.2, §1.5). Rows
// x [M, H*d] hold H heads of d contiguous columns; every op normalises each head separately, in
// fp32.
#pragma once

#include "ops/autograd.h"

namespace k3::ag {

// x / sqrt(Σ x² + eps) per head of d columns (fla's use_qk_l2norm_in_kernel: eps 1e-6).
Var l2norm(const Var& x, int64_t d, float eps = 1e-6f);

enum class NormGate : uint8_t { None, Sigmoid, Swish };

// y = x / rms(x) · w · act(gate) per head of d columns, rms(x) = sqrt(mean(x²) + eps). w [d] is
// shared by the heads (null: 1); gate has x's shape (null when act is None). act: σ (KDA,
// FusedRMSNormGated(activation='sigmoid')), SiLU (fla GDN "swish") or none (plain RMSNorm per head).
Var gated_rmsnorm(const Var& x, const Var& gate, const Var& w, int64_t d, float eps, NormGate act);

}  // namespace k3::ag
