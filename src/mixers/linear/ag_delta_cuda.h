// CUDA forms of ag_delta.h's ops (ag_delta_cuda.cc), for inputs on the device; forward only.
#pragma once

#include "mixers/linear/ag_delta.h"

namespace k3::ag::gpu {

Var delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const linear::DeltaOptions& opts,
               const DeltaShape& s);
Var kda_gate(const Var& x, const Var& A_log, const Var& dt_bias, int64_t H, int64_t K, KdaGateForm form,
             float lower_bound);

}  // namespace k3::ag::gpu
