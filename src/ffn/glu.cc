#include "ffn/glu.h"

namespace k3 {

GluMlp::GluMlp(int64_t d_model, int64_t hidden, const GluOptions& o)
    : opts(o), gate(d_model, hidden, Bias::None), up(d_model, hidden, Bias::None), down(hidden, d_model, Bias::None) {}

Var GluMlp::activate(const Var& g, const Var& u) const {
  return opts.activation == GluActivation::SiTU ? ag::situ_glu(g, u, opts.situ) : ag::silu_glu(g, u);
}

Var GluMlp::forward(const Var& x) const {  // [M, D]
  const std::vector<Var> gu = apply_each({&gate, &up}, x);  // one grouped GEMM where it can be
  return down(activate(gu[0], gu[1]));
}

void GluMlp::visit(const std::string& prefix, const ParamVisitor& v) const {
  gate.visit(join_name(prefix, opts.names.gate), v);
  up.visit(join_name(prefix, opts.names.up), v);
  down.visit(join_name(prefix, opts.names.down), v);
}

}  // namespace k3
