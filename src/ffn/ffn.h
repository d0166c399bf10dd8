// Ffn: a position-wise feed-forward module (MLP, GLU, MoE). x [M, D] -> y [M, D].
#pragma once

#include <string>

#include "ops/param.h"

namespace k3 {

class Ffn {
 public:
  virtual ~Ffn() = default;
  virtual Var forward(const Var& x) const = 0;
  virtual void visit(const std::string& prefix, const ParamVisitor& v) const = 0;
  // Parameters touched per token (differs from the total for MoE).
  virtual int64_t active_params() const = 0;
};

}  // namespace k3
