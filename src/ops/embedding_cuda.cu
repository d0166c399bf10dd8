// Token and position embeddings on CUDA (ops/embedding.h): a block per row; the backward adds rows
// atomically into the table's gradient.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

template <class T>
__global__ void embed_fwd(const float* table, int64_t vocab, const int64_t* ids, int64_t n, int64_t D, T* y,
                          int* bad) {
  const int64_t row = blockIdx.x;
  const int64_t id = ids[row];
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0 && bad) atomicExch(bad, 1);
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[row * D + d] = from_f32<T>(table[id * D + d]);
}

template <class T>
__global__ void embed_bwd(const int64_t* ids, int64_t D, const T* dy, float* dtable) {
  const int64_t row = blockIdx.x, id = ids[row];
  if (id < 0) return;  // a padding row
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dtable[id * D + d], to_f32(dy[row * D + d]));
}

}  // namespace

void embedding_forward(const float* table, int64_t vocab, const int64_t* ids, int64_t n, int64_t D, void* y,
                       Storage st, bool check_ids) {
  if (!n) return;
  if (!check_ids) {  // the caller validated the ids on the host: no flag, no synchronisation
    K3_DISPATCH_STORAGE(st, T,
                        embed_fwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(table, vocab, ids, n, D,
                                                                                     static_cast<T*>(y), nullptr));
    K3_CUDA_LAUNCHED();
    return;
  }
  device::Buffer bad(sizeof(int));
  device::zero(bad.get(), sizeof(int));
  K3_DISPATCH_STORAGE(st, T,
                      embed_fwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(table, vocab, ids, n, D,
                                                                                   static_cast<T*>(y), bad.as<int>()));
  K3_CUDA_LAUNCHED();
  int flag = 0;
  device::download(&flag, bad.get(), sizeof(int));
  if (flag) throw error("embedding", "a token id is outside the vocabulary [0, ", vocab, ")");
}
void embedding_backward(const int64_t* ids, int64_t n, int64_t D, const void* dy, float* dtable, Storage st) {
  if (!n) return;
  K3_DISPATCH_STORAGE(st, T,
                      embed_bwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(ids, D, static_cast<const T*>(dy),
                                                                                   dtable));
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
