// Prompt-lookup speculation: the drafts are what the n-gram rule names (closed-form cases), greedy
// output with speculation equals greedy output without it, through kept drafts and rollbacks, on
// every memory kind, and sampled speculation keeps the target's distribution (closed forms from
// fresh forwards, χ² tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/random.h"
#include "infer/generate.h"
#include "models/registry.h"

namespace k3 {
namespace {

TEST(Speculate, NgramDraftTakesWhatFollowedTheLatestEarlierOccurrence) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3}, 3, 2), (V{7, 6}));  // the latest one
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 8, 1, 2, 3}, 3, 5), (V{9, 8, 1, 2, 3}));
  EXPECT_EQ(ngram_draft({4, 5, 9, 1, 5}, 3, 2), (V{9, 1}));  // no 3- or 2-gram recurs: the 1-gram 5
  EXPECT_EQ(ngram_draft({1, 2, 3, 4}, 3, 4), V{});            // nothing recurs
  EXPECT_EQ(ngram_draft({7, 7}, 3, 4), (V{7}));               // overlapping: follows the first 7
  EXPECT_EQ(ngram_draft({1}, 3, 4), V{});
}

std::vector<int64_t> run(Model& m, const std::vector<int64_t>& prompt, bool speculate, GenerateStats* st = nullptr) {
  GenerateOptions o;
  o.max_new_tokens = 80;
  o.sampling.temperature = 0;
  o.stop_at_eos = StopAtEos::No;
  o.speculate.ngram = speculate;
  return generate(m, prompt, o, {}, st);
}

std::vector<int64_t> repetitive_prompt(int64_t vocab) {
  std::vector<int64_t> p;
  for (int r = 0; r < 4; ++r)
    for (int64_t t : {3, 1, 4, 1, 5, 9, 2, 6}) p.push_back(t % vocab);
  return p;
}

class SpeculatePresets : public ::testing::TestWithParam<std::string> {};

TEST_P(SpeculatePresets, GreedyOutputIsUnchanged) {
  auto m = build_model(preset_config(GetParam()), GetParam());
  m->init_random(3);
  const auto p = repetitive_prompt(m->vocab_size());
  GenerateStats st;
  EXPECT_EQ(run(*m, p, true, &st), run(*m, p, false));
  EXPECT_GT(st.drafted, 0);
  EXPECT_GT(st.verify_steps, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, SpeculatePresets, ::testing::Values("gpt2-tiny", "kda-tiny", "gdn-tiny", "k3-tiny"));

// A fixture model that keeps some drafts: both the kept path and the rollback path run.
TEST(Speculate, FixtureKeepsDraftsAndMatches) {
  auto m = load_model(std::string(K3_SHARED_DIR) + "/fixtures/models/gpt2-tiny");
  const std::vector<int64_t> p = {1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3};
  GenerateStats st;
  EXPECT_EQ(run(*m, p, true, &st), run(*m, p, false));
  EXPECT_GT(st.accepted, 0);
  EXPECT_LT(st.accepted, st.drafted);
}

// The target's next-token distribution after `seq` in closed form: softmax of the logits / T
// over the top k (ties by id), from a fresh forward of the whole sequence.
std::vector<double> target(const Model& m, const std::vector<int64_t>& seq, float temp, int64_t k) {
  const int64_t V = m.vocab_size();
  std::vector<float> l(static_cast<size_t>(V));
  m.forward(seq.data(), int64_t(seq.size()), nullptr, l.data(), Logits::Last);
  std::vector<int64_t> order(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) order[size_t(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[size_t(a)] > l[size_t(b)]; });
  std::vector<double> p(static_cast<size_t>(V), 0.0);
  double z = 0;
  for (int64_t i = 0; i < k; ++i) z += p[size_t(order[size_t(i)])] = std::exp(double(l[size_t(order[size_t(i)])] - l[size_t(order[0])]) / temp);
  for (auto& x : p) x /= z;
  return p;
}

double chi2_critical(int df) {  // Wilson–Hilferty, z for p = 1e-5
  const double z = 4.265, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

// Pearson's χ² of counts against probabilities p (cells with p = 0 must be empty).
void expect_follows(const std::vector<double>& counts, const std::vector<double>& p, const std::string& what) {
  double n = 0, chi2 = 0;
  int cells = 0;
  for (double c : counts) n += c;
  ASSERT_GT(n, 0) << what;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << what << ": token " << i << " outside the target's support";
      continue;
    }
    const double e = p[i] * n;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++cells;
  }
  EXPECT_LT(chi2, chi2_critical(cells - 1)) << what << " (" << n << " samples)";
}

// Sampled speculation through check_drafts on a real model: with a likely first draft and an
// arbitrary second, the first token out (the draft kept, or the draw replacing it), the second
// given the first draft kept, and the bonus after both kept each follow the target's distribution
// given what precedes them; the context ends having absorbed exactly the kept tokens.
class SampledSpeculation : public ::testing::TestWithParam<std::string> {};

TEST_P(SampledSpeculation, ChecksKeepTheTargetDistribution) {
  auto m = build_model(preset_config(GetParam()), GetParam());
  m->init_random(5);
  const float temp = 1.0f;
  const int64_t k = 4, V = m->vocab_size();
  const std::vector<int64_t> prompt = repetitive_prompt(V);
  const int64_t next = 7;
  std::vector<int64_t> hist = prompt;
  hist.push_back(next);
  const std::vector<double> p1 = target(*m, hist, temp, k);
  const int64_t d1 = int64_t(std::max_element(p1.begin(), p1.end()) - p1.begin());
  const int64_t d2 = (d1 + 1) % V;  // whatever it is, a draft the rule must handle
  std::vector<int64_t> h2 = hist;
  h2.push_back(d1);
  const std::vector<double> p2 = target(*m, h2, temp, k);
  std::vector<int64_t> h3 = h2;
  h3.push_back(d2);
  const std::vector<double> p3 = target(*m, h3, temp, k);

  Context base = m->new_context(64);
  std::vector<float> scratch(static_cast<size_t>(V));
  m->forward(prompt.data(), int64_t(prompt.size()), &base, scratch.data(), Logits::Last);
  SamplingOptions so;
  so.temperature = temp, so.top_k = k, so.seed = 1;
  Sampler sampler(so);
  std::vector<double> first(static_cast<size_t>(V)), second(static_cast<size_t>(V)), third(static_cast<size_t>(V));
  const int trials = 3000;
  bool compared[3] = {};
  for (int i = 0; i < trials; ++i) {
    Context ctx = base.clone();
    const DraftCheck c = check_drafts(*m, ctx, next, {d1, d2}, &sampler, hist);
    ASSERT_GE(c.bonus, 0);
    ASSERT_EQ(ctx.position, int64_t(prompt.size()) + 1 + c.kept);
    first[size_t(c.kept >= 1 ? d1 : c.bonus)] += 1;
    if (c.kept >= 1) second[size_t(c.kept >= 2 ? d2 : c.bonus)] += 1;
    if (c.kept == 2) third[size_t(c.bonus)] += 1;
    if (!compared[size_t(c.kept)]) {  // the rolled-back (or kept) context continues as a fresh prefill would
      compared[size_t(c.kept)] = true;
      std::vector<int64_t> seq = hist;
      for (int64_t j = 0; j < c.kept; ++j) seq.push_back(j == 0 ? d1 : d2);
      std::vector<float> got(static_cast<size_t>(V)), want(static_cast<size_t>(V));
      const int64_t probe = 3;
      m->forward(&probe, 1, &ctx, got.data(), Logits::Last);
      seq.push_back(probe);
      m->forward(seq.data(), int64_t(seq.size()), nullptr, want.data(), Logits::Last);
      for (int64_t v = 0; v < V; v += 97) ASSERT_NEAR(got[size_t(v)], want[size_t(v)], 1e-3) << "kept " << c.kept;
    }
  }
  expect_follows(first, p1, "first token");
  expect_follows(second, p2, "second token after the first draft kept");
  if (p2[size_t(d2)] > 0.05) expect_follows(third, p3, "bonus after both drafts kept");
}

INSTANTIATE_TEST_SUITE_P(Models, SampledSpeculation, ::testing::Values("gpt2-tiny", "gdn-tiny"));

// Sampled generation with speculation runs drafts through the rule above; with top-k 1 it is the
// greedy output.
TEST(Speculate, SampledGenerateSpeculatesAndTopOneIsGreedy) {
  auto m = build_model(preset_config("kda-tiny"), "kda-tiny");
  m->init_random(3);
  const auto p = repetitive_prompt(m->vocab_size());
  GenerateOptions o;
  o.max_new_tokens = 80;  // as run()
  o.stop_at_eos = StopAtEos::No;
  o.sampling.temperature = 0.9f;
  o.sampling.top_k = 1;
  o.speculate.ngram = true;
  GenerateStats st;
  EXPECT_EQ(generate(*m, p, o, {}, &st), run(*m, p, false));
  EXPECT_GT(st.drafted, 0);
  o.sampling.top_k = 0;
  o.sampling.seed = 9;
  const auto a = generate(*m, p, o), b = generate(*m, p, o);
  EXPECT_EQ(a, b);  // seeded: reproducible
  EXPECT_EQ(a.size(), p.size() + 80);
}

// A draft model: greedy output is unchanged whether its drafts are all kept (the target itself as
// the draft) or mostly rejected (another initialisation, another architecture), on a recurrent
// target whose context is rolled back; sampled with top-k 1 it is the greedy output too.
TEST(Speculate, DraftModelKeepsGreedyOutput) {
  auto m = build_model(preset_config("kda-tiny"), "kda-tiny");
  m->init_random(3);
  auto same = build_model(preset_config("kda-tiny"), "kda-tiny");
  same->init_random(3);
  auto other = build_model(preset_config("gdn-tiny"), "gdn-tiny");
  other->init_random(4);
  ASSERT_EQ(other->vocab_size(), m->vocab_size());
  const std::vector<int64_t> p = {5, 9, 2, 6, 5, 3, 5, 8, 9, 7};  // no repetition to speak of
  const auto want = run(*m, p, false);
  for (const Model* d : {same.get(), other.get()}) {
    GenerateOptions o;
    o.max_new_tokens = 80;
    o.sampling.temperature = 0;
    o.stop_at_eos = StopAtEos::No;
    o.speculate.draft_model = d;
    GenerateStats st;
    EXPECT_EQ(generate(*m, p, o, {}, &st), want);
    EXPECT_GT(st.drafted, 0);
    EXPECT_EQ(st.check_tokens, st.drafted + st.verify_steps);  // each check: the next token and its drafts
    if (d == same.get()) {
      EXPECT_EQ(st.accepted, st.drafted);  // the target's own picks
      EXPECT_EQ(st.rerun_tokens, 0);       // nothing rejected, nothing re-run
    } else {
      EXPECT_LT(st.accepted, st.drafted);
      EXPECT_GT(st.rerun_tokens, 0);
      EXPECT_GT(st.rerun_seconds, 0.0);
    }
    o.sampling.temperature = 0.7f;
    o.sampling.top_k = 1;
    EXPECT_EQ(generate(*m, p, o), want);
  }
  GenerateOptions o;
  o.speculate.draft_model = other.get();
  o.speculate.ngram = true;
  EXPECT_THROW(generate(*m, p, o), Error);  // one source of drafts
  auto cfg = preset_config("gdn-tiny");
  cfg["vocab_size"] = 512;
  auto narrow = build_model(cfg, "gdn-512");
  narrow->init_random(1);
  o.speculate.ngram = false;
  o.speculate.draft_model = narrow.get();
  EXPECT_THROW(generate(*m, p, o), Error);  // another tokenizer
}

}  // namespace
}  // namespace k3
