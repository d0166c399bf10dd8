// Ffn: a position-wise feed-forward module (MLP, GLU, MoE). x [M, D] -> y [M, D].
#pragma once

#include <string>

#include "core/arena.h"
#include "ops/param.h"

namespace k3 {

class Ffn {
 public:
  virtual ~Ffn() = default;
  virtual void forward(const float* x, int64_t M, float* y, Arena& arena) const = 0;
  virtual void visit(const std::string& prefix, const ParamVisitor& v) = 0;
  // Parameters touched per token (differs from the total for MoE).
  virtual int64_t active_params() const = 0;
};

}  // namespace k3
