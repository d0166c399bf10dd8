#include "models/init.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "core/random.h"

namespace k3 {

void init_normal(const Model& m, uint64_t seed, float std) {
  materialize_params(m);
  Rng rng(seed);
  m.visit([&](const std::string& name, Node& p, ParamKind k) {
    float* w = p.value.f32();
    const int64_t n = p.value.numel();
    if (k == ParamKind::Norm) {
      for (int64_t i = 0; i < n; ++i) w[i] = name.ends_with(".bias") ? 0.0f : 1.0f;
    } else if (k == ParamKind::Bias || k == ParamKind::Other) {
      for (int64_t i = 0; i < n; ++i) w[i] = 0.0f;
    } else {
      // The same values as one sequential stream, drawn in parallel pieces (normal() takes two
      // draws): a real-size model's billions of weights initialise in seconds.
      const uint64_t start = rng.state();
      parallel_for(n, 1 << 16, [&](int64_t i0, int64_t i1) {
        Rng piece(start);
        piece.discard(2 * uint64_t(i0));
        for (int64_t i = i0; i < i1; ++i) w[i] = std * piece.normal();
      });
      rng.discard(2 * uint64_t(n));
    }
  });
}

void init_decay_gates(const Model& m, uint64_t seed) {
  Rng rng(seed ^ 0x5bd1e995u);
  m.visit([&](const std::string& name, Node& p, ParamKind) {
    float* w = p.value.f32();
    const int64_t n = p.value.numel();
    if (name.ends_with("A_log")) {
      for (int64_t i = 0; i < n; ++i) w[i] = std::log(1.0f + 15.0f * rng.uniform());
    } else if (name.ends_with("dt_bias")) {
      for (int64_t i = 0; i < n; ++i) {
        float dt = std::max(1e-4f, std::exp(std::log(1e-3f) + rng.uniform() * (std::log(1e-1f) - std::log(1e-3f))));
        w[i] = dt + std::log(-std::expm1(-dt));
      }
    }
  });
}

}  // namespace k3
