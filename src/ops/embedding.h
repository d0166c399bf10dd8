// Token and position embeddings: row gathers, and their scatter-add backward.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace k3 {

// y[n, D] (+)= table[ids[n], :]. Ids are checked against the table (a clear error, not a read
// out of bounds).
void embedding_forward(const Tensor& table, const int64_t* ids, int64_t n, float* y, float beta = 0.0f);
// dtable[ids[i], :] += dy[i, :]; rows with a negative id (padding) add nothing.
void embedding_backward(const int64_t* ids, int64_t n, int64_t D, const float* dy, float* dtable);

}  // namespace k3
