#include "models/init.h"

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
      for (int64_t i = 0; i < n; ++i) w[i] = std * rng.normal();
    }
  });
}

}  // namespace k3
