// The CUDA form of ag::attnres (ag_attnres_cuda.cc), for sources on the device; forward only.
#pragma once

#include "residual/ag_attnres.h"

namespace k3::ag::gpu {

Var attnres(const std::vector<Var>& sources, const Var& query, const Var& rmsw, float eps);

}  // namespace k3::ag::gpu
