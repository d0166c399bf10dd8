// The CUDA form of ag::attnres (ag_attnres.h): attnres_cuda.cu over device sources, forward and
// (under Recording) backward.
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
  return make_node(std::move(y), parents, [sources, query, rmsw, eps, M, D](Node& self) {
    std::vector<const float*> s;
    std::vector<float*> ds;
    for (const auto& x : sources) {
      s.push_back(x->value.cuda_f32());
      ds.push_back(needs_grad(x) ? x->grad_cuda() : nullptr);
    }
    k3::cuda::attnres_backward(s, query->value.cuda_f32(), rmsw->value.cuda_f32(), eps, self.grad.cuda_f32(), ds,
                               needs_grad(query) ? query->grad_cuda() : nullptr,
                               needs_grad(rmsw) ? rmsw->grad_cuda() : nullptr, AttnResShape{M, D});
  }, "attnres");
}

}  // namespace k3::ag::gpu
