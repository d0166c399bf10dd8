// Internals shared by the recurrent reference and the chunked form: the resolved problem (raw
// pointers, sizes, sequence segments) and the per-implementation entry points. Not a public API.
#pragma once

#include <cstdint>
#include <vector>

#include "mixers/linear/delta_core.h"

namespace k3::linear::detail {

// One sequence: `len` consecutive token rows of the flattened [B·T] row index, from `row0`.
struct Segment {
  int64_t row0 = 0;
  int64_t len = 0;
};

// The unnormalised core problem (the normaliser is a wrapper around it, see delta_core.cc).
struct Problem {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0;
  int64_t group = 1;  // HV / H value heads per q/k head
  Write write = Write::Delta;
  Decay decay = Decay::None;
  float scale = 1.0f;
  int chunk = 64;
  std::vector<Segment> seqs;  // N entries
  const float* q = nullptr;     // [B, T, H, K]
  const float* k = nullptr;     // [B, T, H, K]
  const float* v = nullptr;     // [B, T, HV, V]
  const float* beta = nullptr;  // [B, T, HV] or null (Additive)
  const float* g = nullptr;     // [B, T, HV] / [B, T, HV, K] or null (None)
  const float* h0 = nullptr;    // [N, HV, K, V] or null (zeros)

  const float* q_row(int64_t r, int64_t h) const { return q + (r * H + h) * K; }
  const float* k_row(int64_t r, int64_t h) const { return k + (r * H + h) * K; }
  const float* v_row(int64_t r, int64_t hv) const { return v + (r * HV + hv) * V; }
  float beta_at(int64_t r, int64_t hv) const { return beta ? beta[r * HV + hv] : 1.0f; }
  // Log-decay of channel d at row r (0 without decay; the scalar gate is shared by all channels).
  float g_at(int64_t r, int64_t hv, int64_t d) const {
    if (decay == Decay::None) return 0.0f;
    if (decay == Decay::Scalar) return g[r * HV + hv];
    return g[(r * HV + hv) * K + d];
  }
  int64_t state_off(int64_t n, int64_t hv) const { return (n * HV + hv) * K * V; }
};

// Output and gradient buffers (contiguous, in the layouts above). Gradient buffers must be
// zero-filled by the caller; null ones are skipped where that saves work.
struct Outputs {
  float* o = nullptr;   // [B, T, HV, V]
  float* ht = nullptr;  // [N, HV, K, V]
};
struct Grads {
  const float* d_o = nullptr;  // [B, T, HV, V] or null
  const float* dht = nullptr;  // [N, HV, K, V] or null
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  float* dbeta = nullptr;  // Delta only
  float* dg = nullptr;     // Scalar / PerChannel only
  float* dh0 = nullptr;
};

// Grain for parallel_for over (sequence, head) tasks: below about 2^18 multiply-adds in total the
// work stays on the calling thread (an OpenMP team costs more than it saves on tiny problems, and
// much more on a busy machine).
inline int64_t task_grain(const Problem& p) {
  int64_t longest = 1;
  for (const Segment& s : p.seqs) longest = longest > s.len ? longest : s.len;
  const int64_t work = longest * p.group * p.K * p.V;
  return work >= (int64_t(1) << 18) ? 1 : ((int64_t(1) << 18) + work - 1) / work;
}

void reference_forward(const Problem& p, const Outputs& out);
void reference_backward(const Problem& p, const Grads& gr);
void chunked_forward(const Problem& p, const Outputs& out);
void chunked_backward(const Problem& p, const Grads& gr);
// delta_cuda.cu: the GPU kernels, host buffers in and out; `io` (F32 or BF16) is the storage
// type of q/k/v on the device, `o_dtype` / `do_dtype` that of o and its cotangent (F32 for the
// normaliser's intermediates); β, g, state and gradients stay fp32. The recurrent or the chunked
// kernels run as `impl` says.
void cuda_forward(const Problem& p, const Outputs& out, DType io, DType o_dtype, Impl impl);
void cuda_backward(const Problem& p, const Grads& gr, DType io, DType do_dtype, Impl impl);

}  // namespace k3::linear::detail
