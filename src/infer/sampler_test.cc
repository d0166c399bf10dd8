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

// Speculative sampling with a deterministic draft: whatever the draft (likely, unlikely, outside
// the top-k, the argmax, absent at temperature 0), verify()'s tokens follow the target
// distribution. The target is computed here in closed form: softmax of the scaled logits over the
// kept prefix; a Pearson χ² over the support stays under its 1e-5 critical value (fixed seeds).
double chi2_critical(int df) {  // Wilson–Hilferty, z for p = 1e-5
  const double z = 4.265, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}
TEST(Sampler, VerifyFollowsTheTargetForAnyDraft) {
  struct Case {
    SamplingOptions o;
    size_t keep;  // the closed form's support: the first `keep` of kLogits
    int64_t draft;
  };
  auto opts = [](float temp, int64_t k, float p) {
    SamplingOptions o;
    o.temperature = temp, o.top_k = k, o.top_p = p, o.seed = 11;
    return o;
  };
  // top_p 0.8 at temperature 1: cumulative masses 0.43, 0.70, 0.86, ... keep 3.
  const std::vector<Case> cases = {{opts(1.0f, 0, 1.0f), 5, 0}, {opts(1.0f, 0, 1.0f), 5, 4},
                                   {opts(0.7f, 3, 1.0f), 3, 1}, {opts(0.7f, 3, 1.0f), 3, 4},
                                   {opts(1.0f, 0, 0.8f), 3, 2}, {opts(1.5f, 0, 1.0f), 5, 3}};
  const int draws = 200000;
  for (const Case& c : cases) {
    Sampler s(c.o);
    std::vector<double> count(kLogits.size(), 0);
    int kept = 0;
    for (int i = 0; i < draws; ++i) {
      std::vector<float> l = kLogits;
      const int64_t t = s.verify(l.data(), int64_t(l.size()), {}, c.draft);
      count[size_t(t)] += 1;
      kept += t == c.draft;
    }
    const std::vector<double> p = softmax(kLogits, c.o.temperature, c.keep);
    std::vector<double> want = p;
    if (c.o.top_p < 1.0f) {  // renormalised over the kept prefix
      double z = 0;
      for (size_t i = 0; i < c.keep; ++i) z += p[i];
      for (auto& x : want) x /= z;
    }
    double chi2 = 0;
    for (size_t i = 0; i < kLogits.size(); ++i) {
      if (i >= c.keep) {
        EXPECT_EQ(count[i], 0) << "token " << i << " outside the support, draft " << c.draft;
        continue;
      }
      const double e = want[i] * draws;
      chi2 += (count[i] - e) * (count[i] - e) / e;
    }
    EXPECT_LT(chi2, chi2_critical(int(c.keep) - 1)) << "draft " << c.draft << " top_k " << c.o.top_k;
    // The draft is kept exactly as often as the target draws it.
    const double pd = size_t(c.draft) < c.keep ? want[size_t(c.draft)] : 0.0;
    EXPECT_NEAR(double(kept) / draws, pd, 5 * std::sqrt(pd * (1 - pd) / draws) + 1e-9);
  }
  // Temperature 0: the argmax whatever the draft.
  SamplingOptions g;
  g.temperature = 0;
  Sampler s(g);
  for (int64_t d : {0, 2, 4}) {
    std::vector<float> l = kLogits;
    EXPECT_EQ(s.verify(l.data(), 5, {}, d), 0);
  }
}

// distribution() is the closed form sample() draws from, repetition penalty included.
TEST(Sampler, DistributionIsTheClosedForm) {
  SamplingOptions o;
  o.temperature = 0.5f, o.top_k = 4, o.repetition_penalty = 2.0f;
  Sampler s(o);
  std::vector<float> l = kLogits;
  const auto d = s.distribution(l.data(), 5, {0, 3});  // token 0: 2 → 1; token 3: 0 → 0
  // Penalised and scaled: {2, 3, 2, 0, -2}; top 4 in logit order: 1, 0, 2, 3 (ties by id).
  const std::vector<float> pen = {1.0f, 1.5f, 1.0f, 0.0f};
  double z = 0;
  for (float x : pen) z += std::exp(double(x) / 0.5);
  ASSERT_EQ(d.size(), 4u);
  const int64_t order[4] = {1, 0, 2, 3};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(d[i].first, order[i]);
    EXPECT_NEAR(d[i].second, std::exp(double(pen[size_t(order[i])]) / 0.5) / z, 1e-12);
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
