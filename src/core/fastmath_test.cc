// The branch-free exp against the C library's in double: within 3e-7 relative (about 1.4 float
// ulps at worst) over [−87.3, 88], exactly 1 at 0, and 0 below −87.3; the array form (its ISA
// clone) the same.
#include "core/fastmath.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace k3 {

TEST(FastMath, ExpMatchesTheLibrary) {
  EXPECT_EQ(exp_approx(0.0f), 1.0f);
  EXPECT_EQ(exp_approx(-88.0f), 0.0f);
  EXPECT_EQ(exp_approx(-1e4f), 0.0f);
  std::vector<float> x;
  for (float v = -87.3f; v <= 88.0f; v += 1e-4f * (1.0f + std::fabs(v))) x.push_back(v);
  std::vector<float> y(x.size());
  exp_array(x.data(), y.data(), int64_t(x.size()));
  double worst = 0, worst_array = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(double(x[i]));
    worst = std::max(worst, std::fabs(double(exp_approx(x[i])) - want) / want);
    worst_array = std::max(worst_array, std::fabs(double(y[i]) - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_LT(worst_array, 3e-7);
}

// The shifted form (a softmax row's maximum subtracted in the same pass).
TEST(FastMath, ExpArrayWithShift) {
  std::vector<float> x, y;
  for (float v = -60.0f; v <= 20.0f; v += 0.37f) x.push_back(v);
  y.resize(x.size());
  exp_array(x.data(), y.data(), int64_t(x.size()), 20.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(double(x[i] - 20.0f));  // the difference is taken in fp32
    EXPECT_NEAR(y[i], want, 3e-7 * want) << x[i];
  }
}

// tanh and σ built on it, against the C library in double, over every region their branches
// split (the small-|x| series below 0.3, the exponential form above, saturation).
TEST(FastMath, TanhAndSigmoidMatchTheLibrary) {
  EXPECT_EQ(tanh_approx(0.0f), 0.0f);
  EXPECT_EQ(tanh_approx(30.0f), 1.0f);
  EXPECT_EQ(tanh_approx(-1e6f), -1.0f);
  EXPECT_EQ(sigmoid_approx(0.0f), 0.5f);
  EXPECT_EQ(sigmoid_approx(200.0f), 1.0f);
  EXPECT_LT(sigmoid_approx(-200.0f), 1e-37f);
  double worst_tanh = 0, worst_sigmoid = 0;
  for (float v = 1e-6f; v < 40.0f; v *= 1.0001f)
    for (float x : {v, -v}) {
      const double t = std::tanh(double(x)), s = 1.0 / (1.0 + std::exp(-double(x)));
      worst_tanh = std::max(worst_tanh, std::fabs(double(tanh_approx(x)) - t) / std::fabs(t));
      worst_sigmoid = std::max(worst_sigmoid, std::fabs(double(sigmoid_approx(x)) - s) / s);
    }
  EXPECT_LT(worst_tanh, 4e-7);
  EXPECT_LT(worst_sigmoid, 4e-7);
}

}  // namespace k3
