#include "core/random.h"

#include <cmath>

namespace k3 {

float Rng::normal() {
  double u1 = uniform_double(), u2 = uniform_double();
  if (u1 < 1e-300) u1 = 1e-300;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace k3
