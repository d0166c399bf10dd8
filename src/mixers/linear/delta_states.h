// The delta layer's inference ops over its memories (RecurrentState), on the device where the
// memories live: the short convolutions continuing each sequence's conv tails, and the state step
// continuing each sequence's recurrent state. Inference only: no graph through the memories.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/memory.h"

namespace k3::linear {

// Throws, before any memory moves on, when the state step cannot take heads of K × V on `device`.
void check_state_step(Device device, int64_t K, int64_t V);

// The conv streams (q, k, v: tails 0, 1, 2 of each sequence's state) continuing each sequence's
// tails: xs[s] [B·T, C_s], ws[s] [C_s, W]; silu applies y·σ(y). Every tail moves on by T.
std::vector<Tensor> convs_with_tails(const std::vector<Tensor>& xs, const std::vector<Tensor>& ws, int64_t B, int64_t T,
                                     int64_t W, bool silu, Memory* const* memories);

struct DeltaBatch {
  int64_t B, T, H, HV, K, V;
};
// A delta layer's activations done inside the decode step (T = 1): q and k normalised over K
// (l2norm, eps 1e-6), β = σ(beta) (beta holds its logits), and, unless `gate` is LogDecay, g
// computed from the gate's pre-activations by that KDA gate form (`lower_bound` for LowerBound)
// with A_log [≥ HV] and dt_bias [HV·K] (per channel) or [HV] (scalar decay). On CUDA they run
// inside the step's kernel (linear::cuda::DecodePrologue), one launch where there were five.
struct DecodeActivations {
  bool l2norm = false;
  bool beta_logit = false;
  cuda::GateInput gate = cuda::GateInput::LogDecay;
  float lower_bound = -5.0f;
  Tensor A_log, dt_bias;
};
// The delta rule continuing each sequence's state (and counting the tokens into its length):
// q, k [B·T, H·K], v [B·T, HV·V], beta [B·T, HV], g [B·T, HV] or [B·T, HV·K] as `opts` asks.
// Returns o [B·T, HV·V].
Tensor delta_with_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                         const DeltaOptions& opts, const DeltaBatch& s, Memory* const* memories,
                         const DecodeActivations* act = nullptr);

}  // namespace k3::linear
