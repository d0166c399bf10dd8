// The tensor-core form of the causal attention (attention_mma_cuda.cu), behind
// cuda::attention_forward / attention_backward (and their packed-q/k/v forms) for bf16 storage.
#pragma once

#include "ops/ops_cuda.h"

namespace k3::cuda {

// Elements between consecutive rows (tokens) of q, k and v: H·hd (H·hdv for v) when each is its
// own contiguous [B, T, H, d] array, 3·H·hd when they are the column blocks of a fused projection's
// [B·T, 3·H·hd] output.
struct QkvRows {
  int64_t q, k, v;
};

// Where the backward's gradients go. dq (fp32 [B, Tq, H, hd]) is added to atomically. dk and dv:
// fp32 [B, S, H, d], added to (accumulate_kv) or written over; or, when dk_b is set, bf16 rows
// ld_b elements apart (dk at dk_b, dv at dv_b, head h at column h·d), written over. dbias_k and
// dbias_v (may be null, both or neither) receive dk's and dv's column sums ([H·d], +=).
struct AttnGrads {
  float *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bool accumulate_kv = true;
  void *dk_b = nullptr, *dv_b = nullptr;
  int64_t ld_b = 0;
  float *dbias_k = nullptr, *dbias_v = nullptr;
};

// Runs the forward on the tensor cores (wgmma: sm_90a) when it can: bf16 storage (the caller's),
// head dims hd = hdv ∈ {64, 128} or hd 192 / hdv 128 (MLA), 16-byte-aligned arrays and row
// strides (rows: null = contiguous). Returns false, having launched nothing, for any other shape;
// the SIMT kernels take those.
bool attention_forward_mma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a,
                           const QkvRows* rows = nullptr);
// The backward, given each query row's D = Σ dy·y [B, H, Tq] (dy contiguous): hd = hdv ∈ {64, 128},
// 16-byte-aligned arrays and row strides, else false.
bool attention_backward_mma(const void* q, const void* k, const void* v, const float* lse, const float* D,
                            const void* dy, const AttnGrads& grads, const AttnShape& a,
                            const QkvRows* rows = nullptr);

}  // namespace k3::cuda
