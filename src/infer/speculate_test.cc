// Prompt-lookup speculation: the drafts are what the n-gram rule names (closed-form cases), and
// greedy output with speculation equals greedy output without it, through kept drafts and
// rollbacks, on every memory kind.
#include <gtest/gtest.h>

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
  // Sampling is refused, not silently run without speculation.
  GenerateOptions o;
  o.sampling.temperature = 0.8f;
  o.speculate.ngram = true;
  EXPECT_THROW(generate(*m, p, o), Error);
}

}  // namespace
}  // namespace k3
