#include "residual/ag_attnres.h"

#include "ops/ag_cuda.h"
#include "residual/ag_attnres_cuda.h"
#include "residual/attnres.h"

namespace k3 {

namespace ag {

Var attnres(const std::vector<Var>& sources, const Var& query, const Var& rmsw, float eps) {
  K3_CHECK(!sources.empty(), "attnres with no sources");
  K3_AG_CUDA(sources[0], attnres(sources, query, rmsw, eps));
  const int64_t D = sources[0]->value.dim(-1), M = sources[0]->value.numel() / D;
  std::vector<const float*> src;
  for (const auto& s : sources) {
    K3_CHECK(s->value.shape() == sources[0]->value.shape(), "attnres: sources differ in shape");
    src.push_back(s->value.f32());
  }
  K3_CHECK(query->value.numel() == D && rmsw->value.numel() == D, "attnres: query/norm must have ", D, " values");
  Tensor y = Tensor::empty(sources[0]->value.shape());
  attnres_forward(src, query->value.f32(), rmsw->value.f32(), eps, y.f32(), AttnResShape{M, D});
  std::vector<Var> parents = sources;
  parents.push_back(query);
  parents.push_back(rmsw);
  return make_node(std::move(y), parents, [sources, query, rmsw, eps, M, D](Node& self) {
    std::vector<const float*> s;
    std::vector<float*> ds;
    for (const auto& x : sources) {
      s.push_back(x->value.f32());
      ds.push_back(needs_grad(x) ? x->grad_f32() : nullptr);
    }
    attnres_backward(s, query->value.f32(), rmsw->value.f32(), eps, self.grad.f32(), ds,
                     needs_grad(query) ? query->grad_f32() : nullptr, needs_grad(rmsw) ? rmsw->grad_f32() : nullptr,
                     AttnResShape{M, D});
  }, "attnres");
}

}  // namespace ag

AttnResMix::AttnResMix(int64_t D, float e) : proj(parameter({1, D})), norm(parameter({D})), eps(e) {}

Var AttnResMix::operator()(const std::vector<Var>& blocks, const Var& p) const {
  if (blocks.empty()) return p;
  std::vector<Var> sources = blocks;
  sources.push_back(p);
  return ag::attnres(sources, proj, norm, eps);
}

void AttnResMix::visit(const std::string& proj_name, const std::string& norm_name, const ParamVisitor& v) const {
  v(proj_name + ".weight", *proj, ParamKind::Other);  // pseudo-query: zero-initialised, no decay
  v(norm_name + ".weight", *norm, ParamKind::Norm);
}

}  // namespace k3
