// RoPE's two pairings against the closed forms they implement: DeepSeek's adjacent pairs, and the
// rotate-half of Llama / Qwen (transformers' apply_rotary_pos_emb: x·cos + rotate_half(x)·sin with
// cos, sin = cat(freqs, freqs)), on a partial rotation (the first columns of each head).
#include "ops/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>


namespace k3 {

namespace {
std::vector<float> random_rows(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(rng);
  return x;
}
}  // namespace

TEST(Rope, RotateHalfPairsMatchTransformersFormula) {
  const int64_t M = 5, H = 3, hd = 32, rot = 8;
  RopeTable t = make_rope(rot, 10000.0);
  t.half_pairs = true;
  const std::vector<int64_t> pos = {0, 1, 7, 300, 4095};
  const std::vector<float> x = random_rows(M * H * hd, 1);
  std::vector<float> y = x;
  rope_apply(y.data(), M, H, hd, 0, pos.data(), t, +1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = x.data() + (m * H + h) * hd;
      const float* yr = y.data() + (m * H + h) * hd;
      for (int64_t j = 0; j < hd; ++j) {
        if (j >= rot) {  // past the rotated columns: unchanged
          EXPECT_EQ(yr[j], xr[j]);
          continue;
        }
        const int64_t i = j % (rot / 2);  // emb = cat(freqs, freqs)
        const double inv = 1.0 / std::pow(10000.0, double(2 * i) / double(rot)), a = double(pos[size_t(m)]) * inv;
        const double rh = j < rot / 2 ? -double(xr[j + rot / 2]) : double(xr[j - rot / 2]);  // rotate_half
        EXPECT_NEAR(yr[j], double(xr[j]) * std::cos(a) + rh * std::sin(a), 1e-5) << m << " " << h << " " << j;
      }
    }
  rope_apply(y.data(), M, H, hd, 0, pos.data(), t, -1);  // the inverse rotation undoes it
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(Rope, AdjacentPairsMatchTheirClosedForm) {
  const int64_t M = 3, H = 2, hd = 16, rot = 8, offset = 4;
  const RopeTable t = make_rope(rot, 500.0);
  const std::vector<int64_t> pos = {2, 9, 1000};
  const std::vector<float> x = random_rows(M * H * hd, 2);
  std::vector<float> y = x;
  rope_apply(y.data(), M, H, hd, offset, pos.data(), t, +1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = x.data() + (m * H + h) * hd + offset;
      const float* yr = y.data() + (m * H + h) * hd + offset;
      for (int64_t i = 0; i < rot / 2; ++i) {
        const double a = double(pos[size_t(m)]) / std::pow(500.0, double(2 * i) / double(rot));
        EXPECT_NEAR(yr[2 * i], xr[2 * i] * std::cos(a) - xr[2 * i + 1] * std::sin(a), 1e-5);
        EXPECT_NEAR(yr[2 * i + 1], xr[2 * i] * std::sin(a) + xr[2 * i + 1] * std::cos(a), 1e-5);
      }
    }
}

}  // namespace k3
