// Mixer: a sequence mixer (one row of the memory table). Reads x [B*T, D] for B sequences of T
// tokens and returns y [B*T, D]. Without memories the sequences start from scratch (prefill,
// training); with memories (one per sequence) they continue them (decode, chunked prefill) and
// the memories absorb the new tokens.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mixers/memory.h"
#include "ops/param.h"

namespace k3 {

// Bytes one sequence's memory needs: `per_token` grows with context, `fixed` does not.
struct MemorySpec {
  MemoryKind kind;
  double per_token_bytes = 0;
  double fixed_bytes = 0;
};

struct SeqBatch {
  int64_t B = 1, T = 0;
  Memory* const* memories = nullptr;  // B entries, or null
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual Var forward(const Var& x, const SeqBatch& batch) const = 0;
  virtual std::unique_ptr<Memory> new_memory(int64_t max_tokens) const = 0;
  virtual std::vector<MemorySpec> memory_spec() const = 0;
  virtual void visit(const std::string& prefix, const ParamVisitor& v) const = 0;
  virtual std::string_view name() const = 0;
};

}  // namespace k3
