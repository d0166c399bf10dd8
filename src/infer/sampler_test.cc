// Samplers against closed forms: the empirical distribution of many draws matches the softmax
// of the (temperature-scaled, truncated) logits.
#include "infer/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace k3 {

namespace {
std::vector<double> empirical(SamplingOptions o, const std::vector<float>& logits, int draws) {
  Sampler s(o);
  std::vector<double> freq(logits.size(), 0);
  for (int i = 0; i < draws; ++i) {
    std::vector<float> l = logits;
    freq[size_t(s.sample(l.data(), int64_t(l.size()), {}))] += 1.0 / draws;
  }
  return freq;
}
std::vector<double> softmax(const std::vector<float>& l, float temp, size_t keep) {
  std::vector<double> p(l.size(), 0);
  double z = 0;
  for (size_t i = 0; i < keep; ++i) z += p[i] = std::exp(double(l[i]) / temp);
  for (auto& x : p) x /= z;
  return p;
}
}  // namespace

const std::vector<float> kLogits = {2.0f, 1.5f, 1.0f, 0.0f, -1.0f};  // sorted, descending

// A whole vocabulary (no top-k or top-p: the sampler's unsorted path) of 1,000 logits spread over
// 30 units, some far below the rest: the draws' frequencies of the 8 likeliest tokens and of the
// tail match the softmax.
TEST(Sampler, WholeVocabularyDrawsMatchTheSoftmax) {
  const int64_t V = 1000;
  std::vector<float> l(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) l[size_t(i)] = -30.0f + 30.0f * float((i * 7919) % V) / float(V);
  l[3] = 2.5f, l[500] = 2.0f, l[999] = 1.0f, l[7] = -200.0f;
  SamplingOptions o;
  o.temperature = 1.3f;
  o.seed = 17;
  auto f = empirical(o, l, 40000);
  double z = 0;
  std::vector<double> p(l.size());
  for (size_t i = 0; i < l.size(); ++i) z += p[i] = std::exp(double(l[i]) / 1.3);
  for (size_t i = 0; i < l.size(); ++i) p[i] /= z;
  for (size_t i : {size_t(3), size_t(500), size_t(999)}) EXPECT_NEAR(f[i], p[i], 0.01) << i;
  EXPECT_EQ(f[7], 0.0);
  double tail_f = 0, tail_p = 0;
  for (size_t i = 0; i < l.size(); ++i)
    if (i != 3 && i != 500 && i != 999) tail_f += f[i], tail_p += p[i];
  EXPECT_NEAR(tail_f, tail_p, 0.01);
}

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  SamplingOptions o;
  o.temperature = 0;
  Sampler s(o);
  std::vector<float> l = {0.5f, 3.0f, 3.0f, -1.0f};
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, TemperatureMatchesSoftmax) {
  SamplingOptions o;
  o.temperature = 0.7f;
  o.seed = 3;
  auto f = empirical(o, kLogits, 40000);
  auto p = softmax(kLogits, 0.7f, kLogits.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i], 0.01) << i;
}

TEST(Sampler, TopKRenormalisesOverTheKBest) {
  SamplingOptions o;
  o.top_k = 2;
  o.seed = 5;
  auto f = empirical(o, kLogits, 40000);
  auto p = softmax(kLogits, 1.0f, 2);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i], 0.01) << i;
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  // softmax(kLogits) = [.416, .252, .153, .056, .021]: top_p 0.6 keeps the first two.
  SamplingOptions o;
  o.top_p = 0.6f;
  o.seed = 9;
  auto f = empirical(o, kLogits, 40000);
  auto p = softmax(kLogits, 1.0f, 2);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i], 0.01) << i;
}

TEST(Sampler, RepetitionPenaltyFollowsHuggingFace) {
  SamplingOptions o;
  o.temperature = 0;
  o.repetition_penalty = 2.0f;
  Sampler s(o);
  // Token 0 (logit 3) was seen: 3/2 = 1.5 < 2 -> token 1 wins; a seen negative logit doubles.
  std::vector<float> l = {3.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.sample(l.data(), 3, {0, 2}), 1);
  EXPECT_EQ(l[2], -2.0f);
}

TEST(Sampler, SameSeedSameDraws) {
  SamplingOptions o;
  o.seed = 11;
  Sampler a(o), b(o);
  for (int i = 0; i < 100; ++i) {
    std::vector<float> l1 = kLogits, l2 = kLogits;
    EXPECT_EQ(a.sample(l1.data(), 5, {}), b.sample(l2.data(), 5, {}));
  }
}

TEST(Sampler, RejectsInvalidSettings) {
  SamplingOptions o;
  o.top_p = 0;
  EXPECT_THROW(Sampler{o}, Error);
  o = {};
  o.temperature = -1;
  EXPECT_THROW(Sampler{o}, Error);
  o = {};
  o.repetition_penalty = 0;
  EXPECT_THROW(Sampler{o}, Error);
}

}  // namespace k3
