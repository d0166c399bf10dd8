// Deterministic random numbers, identical on every platform and compiler (no std::
// distributions, whose output is implementation-defined). SplitMix64 core.
#pragma once

#include <cstdint>

namespace k3 {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(seed) {}
  uint64_t next_u64() {
    uint64_t z = (state_ += kGamma);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 bits (exactly representable in float) or 53 bits.
  float uniform() { return float(next_u64() >> 40) * (1.0f / 16777216.0f); }
  double uniform_double() { return double(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }
  float normal();  // Box-Muller
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }
  // Skips n draws of next_u64 (the state moves by a constant per draw): a stream can be cut into
  // pieces generated in parallel, each from where it starts. normal() takes two draws.
  void discard(uint64_t n) { state_ += n * kGamma; }

  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;

 private:
  uint64_t state_;
};

}  // namespace k3
