#include "ffn/mlp.h"

namespace k3 {

GeluMlp::GeluMlp(int64_t d_model, int64_t hidden, WeightLayout layout)
    : c_fc(d_model, hidden, Bias::Present, layout), c_proj(hidden, d_model, Bias::Present, layout) {}

void GeluMlp::visit(const std::string& prefix, const ParamVisitor& v) const {
  c_fc.visit(join_name(prefix, "c_fc"), v);
  c_proj.visit(join_name(prefix, "c_proj"), v);
}

}  // namespace k3
