// Token samplers: greedy, temperature, top-k, top-p, repetition penalty, seeded. Applied in
// Hugging Face's order: repetition penalty, temperature, top-k, top-p, then a draw.
#pragma once

#include <cstdint>
#include <vector>

#include "core/random.h"

namespace k3 {

struct SamplingOptions {
  float temperature = 1.0f;        // 0: greedy
  int64_t top_k = 0;               // 0: off
  float top_p = 1.0f;              // 1: off
  float repetition_penalty = 1.0f; // 1: off (HF: divide positive logits, multiply negative ones)
  uint64_t seed = 0;
  void validate() const;           // k3::Error on out-of-range values
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& o) : o_(o), rng_(o.seed) { o.validate(); }
  // logits [V] (modified in place); history = tokens so far (for the repetition penalty).
  int64_t sample(float* logits, int64_t V, const std::vector<int64_t>& history);
  // True when sample() is the plain argmax (temperature 0, no repetition penalty): the caller may
  // then take Model::greedy's pick instead, which on the device brings back ids, not logits.
  bool greedy() const { return o_.temperature == 0.0f && o_.repetition_penalty == 1.0f; }

 private:
  SamplingOptions o_;
  Rng rng_;
  std::vector<int64_t> order_;
  std::vector<float> weights_;  // the whole-vocabulary draw's e^(l − max), kept between calls
};

}  // namespace k3
