// The language-model head as an op on the device where the hidden rows live: logits (all rows, or
// the last row of each sequence) and greedy picks, delivered to host buffers; and the forms that
// leave their result on the device, for a decode step captured as a graph (models/decoder.cc).
#pragma once

#include "models/model.h"

namespace k3 {

// h [B·T, D], head [V, D]. out: [rows, V] host floats; next: B host ids.
void head_logits(Var h, const TokenBatch& batch, Logits which, const Var& head, float* out);
void head_picks(Var h, const TokenBatch& batch, const Var& head, int64_t* next);
// CUDA only: the B picks of the last rows into device ids, or the last rows' logits [B, V] into
// device memory at dst; every kernel queued, nothing downloaded.
void head_picks_on_device(Var h, const TokenBatch& batch, const Var& head, int64_t* ids);
void head_logits_on_device(Var h, const TokenBatch& batch, const Var& head, void* dst);

}  // namespace k3
