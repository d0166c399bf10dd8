// Differentiable per-head layout ops: rows x [M, H*hd] hold H heads of hd columns each.
#pragma once

#include <vector>

#include "ops/autograd.h"
#include "ops/rope.h"

namespace k3::ag {

Var head_slice(const Var& x, int64_t H, int64_t begin, int64_t end);  // [M, H*(end-begin)]
Var head_concat(const std::vector<Var>& xs, int64_t H);               // per head, in order
Var broadcast_heads(const Var& x, int64_t H);                         // [M, d] -> [M, H*d]
// Rotates columns [offset, offset + table.dim) of each head of row m by positions[m].
Var rope(const Var& x, const std::vector<int64_t>& positions, int64_t H, int64_t offset, const RopeTable& table);

}  // namespace k3::ag
