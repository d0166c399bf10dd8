// The CUDA form of ag::attnres (ag_attnres.h), forward only: attnres_cuda.cu over device sources.
#include "residual/ag_attnres_cuda.h"

#include "ops/ag_cuda.h"
#include "residual/attnres_cuda.h"

namespace k3::ag::gpu {

Var attnres(const std::vector<Var>& sources, const Var& query, const Var& rmsw, float eps) {
  K3_CHECK(!sources.empty(), "attnres with no sources");
  if (sources.size() > size_t(k3::cuda::kAttnResMaxSources))
    throw error("attnres", sources.size(), " sources exceed the CUDA kernel's ", k3::cuda::kAttnResMaxSources);
  const int64_t D = sources[0]->value.dim(-1), M = sources[0]->value.numel() / D;
  std::vector<const float*> src;
  for (const auto& s : sources) {
    K3_CHECK(s->value.shape() == sources[0]->value.shape(), "attnres: sources differ in shape");
    src.push_back(in(s, "attnres"));
  }
  K3_CHECK(query->value.numel() == D && rmsw->value.numel() == D, "attnres: query/norm must have ", D, " values");
  Tensor y = empty(sources[0]->value.shape());
  k3::cuda::attnres_forward(src, in(query, "attnres"), in(rmsw, "attnres"), eps, y.cuda_f32(), AttnResShape{M, D});
  std::vector<Var> parents = sources;
  parents.push_back(query);
  parents.push_back(rmsw);
  forward_only("attnres", parents);
  return constant(std::move(y));
}

}  // namespace k3::ag::gpu
