// Model: the interface every architecture implements (one file per architecture, one line in
// registry.cc). A model turns token ids into logits, optionally continuing a per-sequence
// Context (its list of Memory objects), and lists its parameters through one visitor.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "mixers/memory.h"
#include "mixers/mixer.h"
#include "ops/param.h"

namespace k3 {

enum class Logits : uint8_t { All, Last };

// One stateful layer's memory needs, for `k3 info` and the memory report.
struct LayerMemory {
  int64_t layer;
  MemorySpec spec;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string architecture() const = 0;  // the config's model_type
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;
  virtual int64_t num_layers() const = 0;
  virtual void visit(const ParamVisitor& v) = 0;
  virtual Json config_json() const = 0;
  // Parameters touched per token. Default: all but the input embedding tables (as commonly
  // counted; the tied LM head still counts through its use).
  virtual int64_t active_params();
  virtual std::vector<LayerMemory> memory_layers() const = 0;
  virtual Context new_context(int64_t max_tokens) const = 0;
  // ids [T] of one sequence -> logits [T, V] (Logits::All) or [1, V] (Logits::Last). With a
  // context the tokens continue that sequence and its memories absorb them.
  virtual void forward(const int64_t* ids, int64_t T, Context* ctx, float* logits, Logits which) = 0;
  // Fresh random weights (the architecture's own init).
  virtual void init_random(uint64_t seed) = 0;

  std::optional<int64_t> eos_token_id;

  int64_t total_params();
  size_t weight_bytes();  // bytes of the parameters as held now

 protected:
  Arena arena_;
};

// Fills every parameter from a checkpoint by its HF name. `alias` maps our name to the
// candidates to try in the file (e.g. with a "transformer." prefix). Shapes must match; dtypes
// are converted to fp32 (fp32 stays zero-copy). Tensors in the file that nothing asked for are
// reported unless `ignorable` says they are known buffers.
struct LoadOptions {
  std::function<std::vector<std::string>(const std::string&)> alias;
  std::function<bool(const std::string&)> ignorable;
};
void load_params(Model& model, const Checkpoint& ckpt, const LoadOptions& opts);

// Gives every parameter storage (zeros), e.g. before init_random.
void materialize_params(Model& model);

}  // namespace k3
