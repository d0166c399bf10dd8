// Random initialisation shared by the architectures: N(0, std) matrices and embeddings, norms
// at 1, biases at 0, parameters the optimiser must not touch (requires_grad false) left as set.
#pragma once

#include "models/model.h"

namespace k3 {

void init_normal(const Model& m, uint64_t seed, float std);

}  // namespace k3
