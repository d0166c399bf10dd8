// Attention Residuals as a differentiable op and as K3's residual rule (spec §10.3).
#pragma once

#include <vector>

#include "ops/linear.h"

namespace k3 {

namespace ag {
// Σ_j softmax_j(s_j) v_j over sources [M, D] each; query, rmsw: [D] values (any shape of D).
Var attnres(const std::vector<Var>& sources, const Var& query, const Var& rmsw, float eps);
}  // namespace ag

// One AttnRes mixing point: `<name>_proj.weight` [1, D] (the pseudo-query) and
// `<name>_norm.weight` [D] (the key RMSNorm weight).
struct AttnResMix {
  Var proj, norm;
  float eps = 1e-5f;
  AttnResMix() = default;
  AttnResMix(int64_t D, float e);
  // AR(p, blocks): mixes [blocks..., p]; with no blocks it is p itself.
  Var operator()(const std::vector<Var>& blocks, const Var& p) const;
  void visit(const std::string& proj_name, const std::string& norm_name, const ParamVisitor& v) const;
};

}  // namespace k3
