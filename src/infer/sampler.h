// Token samplers: greedy, temperature, top-k, top-p, repetition penalty, seeded. Applied in
// Hugging Face's order: repetition penalty, temperature, top-k, top-p, then a draw.
#pragma once

#include <cstdint>
#include <utility>
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
  // The distribution sample() draws from, as (id, probability) pairs of its support: the
  // repetition penalty, temperature, top-k and top-p applied (one-hot at the argmax for
  // temperature 0). logits are modified in place.
  std::vector<std::pair<int64_t, double>> distribution(float* logits, int64_t V, const std::vector<int64_t>& history);
  // Speculative sampling with a deterministic draft (q = one-hot at `draft`): keeps the draft with
  // probability p(draft), else draws from p with the draft removed and renormalised, so the token
  // returned follows p exactly. Returns the draft when kept.
  int64_t verify(float* logits, int64_t V, const std::vector<int64_t>& history, int64_t draft);

 private:
  SamplingOptions o_;
  Rng rng_;
  std::vector<int64_t> order_;
  std::vector<float> weights_;  // the whole-vocabulary draw's e^(l − max), kept between calls
};

}  // namespace k3
