#include "ops/embedding.h"

namespace k3 {

void embedding_forward(const Tensor& table, const int64_t* ids, int64_t n, float* y, float beta) {
  const int64_t V = table.dim(0), D = table.dim(1);
  const float* t = table.f32();
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= V)
      throw error("embedding", "token id ", ids[i], " at position ", i, " is outside the vocabulary [0, ", V, ")");
    const float* row = t + ids[i] * D;
    float* out = y + i * D;
    if (beta == 0.0f)
      for (int64_t d = 0; d < D; ++d) out[d] = row[d];
    else
      for (int64_t d = 0; d < D; ++d) out[d] = beta * out[d] + row[d];
  }
}

void embedding_backward(const int64_t* ids, int64_t n, int64_t D, const float* dy, float* dtable) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] >= 0)
      for (int64_t d = 0; d < D; ++d) dtable[ids[i] * D + d] += dy[i * D + d];
}

}  // namespace k3
