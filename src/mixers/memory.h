// Memory: the per-sequence state of a mixer (ARCHITECTURE.md, "The memory mechanisms are one
// table"). A KV cache, an MLA latent cache, a recurrent state and a conv tail all implement it,
// so a model's per-sequence context is a list of them and prefix caching, rollback and the
// memory report work for every kind at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace k3 {

enum class MemoryKind : uint8_t { KVCache, LatentCache, RecurrentState, ConvTail };
std::string_view memory_kind_name(MemoryKind k);

class Memory {
 public:
  virtual ~Memory() = default;
  virtual MemoryKind kind() const = 0;
  virtual void reset() = 0;                               // back to the empty sequence
  virtual std::unique_ptr<Memory> clone() const = 0;      // fork / snapshot
  virtual void restore(const Memory& snapshot) = 0;       // copy a snapshot of the same kind back
  // A deep copy with its buffers on `device`: the prefix cache's host tier keeps device snapshots in
  // host memory, holding only the tokens absorbed, and copies them back on a hit. The base class
  // copies on its own device only.
  virtual std::unique_ptr<Memory> clone_to(Device device) const;
  virtual Device device() const { return Device::CPU; }
  virtual size_t bytes() const = 0;                       // bytes allocated now
  virtual int64_t length() const = 0;                     // tokens absorbed
  // Appends n all-zero tokens, allocating what n real ones would (benchmarks: memory at a
  // context, decode speed at a context, without running a prefill). Fixed-size states only
  // count the tokens.
  virtual void extend_zeros(int64_t n) = 0;
  // Sets the count of tokens absorbed without touching the contents: for a decode step replayed
  // as a CUDA graph, whose kernels already wrote the device memory (models/decoder.cc), and
  // to take back a capture that never ran. Device memories only.
  virtual void set_length(int64_t n);
  // Tokens it can hold (fixed-size states: no limit).
  virtual int64_t capacity() const { return INT64_MAX; }
  // Whether truncate() can take tokens back: caches that keep every token's rows can; a state
  // that folds tokens in cannot (it is restored from a snapshot instead).
  virtual bool can_truncate() const { return false; }
  // Back to the first n tokens absorbed (n <= length()); only where can_truncate().
  virtual void truncate(int64_t n);
};

// A sequence's context: one Memory per stateful layer, plus its position.
struct Context {
  std::vector<std::unique_ptr<Memory>> layers;
  int64_t position = 0;
  // The final hidden states of the tokens the context absorbs, kept (on the host) while a
  // multi-token-prediction drafter asks for them: rows of `dim` for positions [start, start + n).
  // A forward from position p keeps the rows before p and appends its own. Clones copy them (a
  // prefix-cache snapshot restores them with the memories).
  struct HiddenRows {
    int64_t start = 0, dim = 0;
    std::vector<float> rows;
    int64_t count() const { return dim ? int64_t(rows.size()) / dim : 0; }
  };
  std::shared_ptr<HiddenRows> hidden;

  size_t bytes() const {
    size_t b = hidden ? hidden->rows.size() * sizeof(float) : 0;
    for (const auto& m : layers) b += m->bytes();
    return b;
  }
  Context clone() const { return clone_to(std::nullopt); }
  Context clone_to(std::optional<Device> device) const {
    Context c;
    c.position = position;
    for (const auto& m : layers) c.layers.push_back(device ? m->clone_to(*device) : m->clone());
    if (hidden) c.hidden = std::make_shared<HiddenRows>(*hidden);
    return c;
  }
};

}  // namespace k3
