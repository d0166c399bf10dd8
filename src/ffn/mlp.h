// GPT-2 MLP (spec §1): c_fc (D -> 4D) -> GELU(tanh) -> c_proj (4D -> D).
#pragma once

#include "ffn/ffn.h"
#include "ops/linear.h"

namespace k3 {

class GeluMlp final : public Ffn {
 public:
  GeluMlp(int64_t d_model, int64_t hidden, WeightLayout layout);
  Var forward(const Var& x) const override { return c_proj(ag::gelu_tanh(c_fc(x))); }
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  int64_t active_params() const override { return c_fc.params() + c_proj.params(); }

  Linear c_fc, c_proj;
};

}  // namespace k3
