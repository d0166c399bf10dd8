// The prefill/decode loop for one sequence: the prompt goes through in one forward pass that
// fills the context's memories, then one token per step.
#pragma once

#include <functional>
#include <vector>

#include "infer/sampler.h"
#include "models/model.h"

namespace k3 {

enum class StopAtEos : uint8_t { Yes, No };

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  SamplingOptions sampling;
  StopAtEos stop_at_eos = StopAtEos::Yes;
};

struct GenerateStats {
  int64_t prompt_tokens = 0, new_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  size_t context_bytes = 0;  // the sequence's memory at the end
};

// Returns prompt + generated ids. on_token(id) is called for each new token as it is made.
std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token = {}, GenerateStats* stats = nullptr);

}  // namespace k3
