// Random initialisation shared by the architectures: N(0, std) matrices and embeddings, norms
// at 1, biases at 0, parameters the optimiser must not touch (requires_grad false) left as set.
#pragma once

#include "models/model.h"

namespace k3 {

void init_normal(const Model& m, uint64_t seed, float std);
// The delta-rule layers' decay parameters, by name: A_log = log A with A ~ U(1, 16), dt_bias =
// softplus⁻¹(dt) with dt ~ logU(1e-3, 1e-1) (the GDN / fla KDA init, spec §4).
void init_decay_gates(const Model& m, uint64_t seed);

}  // namespace k3
