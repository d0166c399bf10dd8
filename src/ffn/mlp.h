// GPT-2 MLP (spec §1): c_fc (D -> 4D) -> GELU(tanh) -> c_proj (4D -> D).
#pragma once

#include "ffn/ffn.h"
#include "ops/linear.h"

namespace k3 {

class GeluMlp final : public Ffn {
 public:
  GeluMlp(int64_t d_model, int64_t hidden, WeightLayout layout);
  void forward(const float* x, int64_t M, float* y, Arena& arena) const override;
  void visit(const std::string& prefix, const ParamVisitor& v) override;
  int64_t active_params() const override { return c_fc.params() + c_proj.params(); }

  Linear c_fc, c_proj;
};

}  // namespace k3
