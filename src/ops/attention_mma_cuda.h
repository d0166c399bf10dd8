// The tensor-core form of the causal attention (attention_mma_cuda.cu), behind
// cuda::attention_forward / attention_backward for bf16 storage.
#pragma once

#include "ops/ops_cuda.h"

namespace k3::cuda {

// Runs the forward on the tensor cores (wgmma: sm_90a) when it can: bf16 storage (the caller's),
// head dims hd = hdv ∈ {64, 128} or hd 192 / hdv 128 (MLA), 16-byte-aligned arrays. Returns false,
// having launched nothing, for any other shape; the SIMT kernels take those.
bool attention_forward_mma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a);
// The backward (gradients accumulated into dq, dk, dv as attention_backward's; dk and dv written
// over instead when !accumulate_kv), given each query row's D = Σ dy·y [B, H, Tq]: hd = hdv ∈
// {64, 128}, 16-byte-aligned arrays, else false.
bool attention_backward_mma(const void* q, const void* k, const void* v, const float* lse, const float* D,
                            const void* dy, float* dq, float* dk, float* dv, const AttnShape& a, bool accumulate_kv);

}  // namespace k3::cuda
