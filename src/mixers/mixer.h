// Mixer: a sequence mixer (one row of the memory table). Reads x [T, D] of one sequence and
// writes y [T, D]; with a Memory it continues that sequence (decode or chunked prefill),
// without one it processes [0, T) from scratch.
#pragma once

#include <memory>
#include <string>

#include "core/arena.h"
#include "mixers/memory.h"
#include "ops/param.h"

namespace k3 {

// Bytes one sequence's memory needs: `per_token` grows with context, `fixed` does not.
struct MemorySpec {
  MemoryKind kind;
  double per_token_bytes = 0;
  double fixed_bytes = 0;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual void forward(const float* x, int64_t T, float* y, Memory* memory, Arena& arena) const = 0;
  virtual std::unique_ptr<Memory> new_memory(int64_t max_tokens) const = 0;
  virtual std::vector<MemorySpec> memory_spec() const = 0;
  virtual void visit(const std::string& prefix, const ParamVisitor& v) = 0;
  virtual std::string_view name() const = 0;
};

}  // namespace k3
