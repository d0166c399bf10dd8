#include "ffn/mlp.h"

#include "ops/activation.h"

namespace k3 {

GeluMlp::GeluMlp(int64_t d_model, int64_t hidden, WeightLayout layout)
    : c_fc(d_model, hidden, Bias::Present, layout), c_proj(hidden, d_model, Bias::Present, layout) {}

void GeluMlp::forward(const float* x, int64_t M, float* y, Arena& arena) const {
  Tensor h = arena.alloc({M, c_fc.out});  // [M, 4D]
  c_fc.forward(x, M, h.f32());
  gelu_tanh_forward(h.f32(), h.f32(), h.numel());
  c_proj.forward(h.f32(), M, y);
}

void GeluMlp::visit(const std::string& prefix, const ParamVisitor& v) {
  c_fc.visit(join_name(prefix, "c_fc"), v);
  c_proj.visit(join_name(prefix, "c_proj"), v);
}

}  // namespace k3
