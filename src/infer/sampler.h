// Token samplers: greedy, temperature, top-k, top-p, repetition penalty, seeded. Applied in
// Hugging Face's order: repetition penalty, temperature, top-k, top-p, then a draw.
#pragma once

#include <bit>
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

// e^x for −87 ≤ x ≤ 0 (callers clamp: the sampler's weights are relative to the largest, 1):
// Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n by the exponent
// bits), within a few ulp of exp in plain arithmetic that the compiler vectorises (a clamp inside
// the same loop keeps GCC from vectorising it).
inline float exp_nonpositive(float x) {
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2), |·| < 2^22
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;                // x − n ln 2, ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);  // 2^n, n in [−126, 0]
}

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
