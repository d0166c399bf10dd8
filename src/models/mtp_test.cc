// The multi-token-prediction head against transformers: deepseek-v3-tiny given one MTP layer
// (tests/data/mtp, made by tools/make_mtp_goldens.py from transformers' DeepseekV3DecoderLayer and
// RMSNorm), its logits row by row, a draft fed its own output, the drafter in generate, and
// greedy output with MTP speculation equal to plain greedy output.
#include <gtest/gtest.h>

#include <filesystem>

#include "infer/generate.h"
#include "infer/serve/scheduler.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "models/lm_head.h"
#include "models/mtp.h"
#include "models/registry.h"
#include "models/testing.h"
#include "ops/ag.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using testing::mtp_golden;

class Mtp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::checkpoint_with_mtp();
    model_ = load_model(dir_).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    fs::remove_all(dir_);
  }
  static std::vector<int64_t> ids() {
    const Tensor t = SafeTensors::open(mtp_golden()).get("ids");
    return std::vector<int64_t>(t.data<int64_t>(), t.data<int64_t>() + t.numel());
  }
  static Tensor logits_of(const MtpHead& h, const Var& o) {
    return ag::linear(h.norm()(o), h.head(), nullptr, WeightLayout::OutIn)->value;
  }
  static inline std::string dir_;
  static inline Model* model_ = nullptr;
};

TEST_F(Mtp, LoadsOnlyWhereTheCheckpointHasTheLayer) {
  ASSERT_NE(model_->mtp(), nullptr);
  EXPECT_EQ(load_model(testing::fixture_model("deepseek-v3-tiny"))->mtp(), nullptr);
}

TEST_F(Mtp, RowsAndADraftMatchTransformers) {
  const SafeTensors gold = SafeTensors::open(mtp_golden());
  const std::vector<int64_t> t = ids();
  const int64_t T = int64_t(t.size()), V = model_->vocab_size();
  const MtpHead& head = *model_->mtp();
  // The model's hidden states of tokens 0 .. T-2 and the tokens one later.
  const Var h = model_->hidden(TokenBatch{t.data(), 1, T - 1, nullptr});
  Context ctx = head.new_context(T);
  const Var o = head.forward(h, std::vector<int64_t>(t.begin() + 1, t.end()), &ctx);
  const Tensor want = gold.get("mtp_logits");
  const Tensor got = logits_of(head, o);
  ASSERT_EQ(got.numel(), (T - 1) * V);
  EXPECT_LT(testing::rel_l2(got.f32(), want.f32(), got.numel()), 1e-4);
  // A draft row: the head's own last output and its pick, continuing the same context.
  const int64_t pick = head.pick(o);
  const Var o2 = head.forward(constant(o->value.slice(0, T - 2, T - 1).clone()), {pick}, &ctx);
  const Tensor d = logits_of(head, o2);
  EXPECT_LT(testing::rel_l2(d.f32(), gold.get("draft_logits").f32(), V), 1e-4);
}

TEST_F(Mtp, DrafterProposesTheReferencePicks) {
  const SafeTensors gold = SafeTensors::open(mtp_golden());
  const std::vector<int64_t> t = ids();
  const int64_t T = int64_t(t.size()), V = model_->vocab_size();
  auto argmax = [&](const Tensor& x, int64_t row) {
    const float* p = x.f32() + row * V;
    return int64_t(std::max_element(p, p + V) - p);
  };
  Context ctx = model_->new_context(T + 8);
  ctx.hidden = std::make_shared<Context::HiddenRows>();  // kept from the first token, as generate does
  MtpDrafter drafter(*model_, ctx, T + 8);
  std::vector<float> last(static_cast<size_t>(V));
  model_->forward(t.data(), T - 1, &ctx, last.data(), Logits::Last);  // the target absorbs 0 .. T-2
  const std::vector<int64_t> d = drafter.draft(t, 2);                    // t[T-1] is checked next
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], argmax(gold.get("mtp_logits"), T - 2));
  EXPECT_EQ(d[1], argmax(gold.get("draft_logits"), 0));
  EXPECT_GT(drafter.bytes(), 0u);
}

TEST_F(Mtp, GreedyOutputWithMtpSpeculationEqualsPlainGreedy) {
  const std::vector<int64_t> prompt = {3, 17, 250, 41, 99};
  GenerateOptions o;
  o.max_new_tokens = 40;
  o.sampling.temperature = 0;
  o.stop_at_eos = StopAtEos::No;
  const auto plain = generate(*model_, prompt, o);
  for (int64_t k : {1, 3}) {
    o.speculate.mtp = true;
    o.speculate.draft_tokens = k;
    GenerateStats st;
    EXPECT_EQ(generate(*model_, prompt, o, {}, &st), plain) << k << " drafts per check";
    EXPECT_GT(st.drafted, 0);
    EXPECT_GT(st.verify_steps, 0);
  }
}

// The server's scheduler with MTP drafts: greedy requests equal generate() without speculation,
// alone and with chunked prefill; the later requests share a prompt prefix, so they start from a
// prefix-cache snapshot (which keeps the hidden states the drafter reads) and still draft.
TEST_F(Mtp, SchedulerOutputsEqualGenerateThroughPrefixHits) {
  const std::vector<int64_t> shared = {3, 17, 250, 41, 99, 7, 7, 300, 12, 480, 5, 66, 8, 9, 10, 11, 200, 201};
  std::vector<serve::GenParams> ps;
  std::vector<std::vector<int64_t>> want;
  for (int i = 0; i < 3; ++i) {
    serve::GenParams g;
    g.prompt = shared;
    for (int t = 0; t <= i; ++t) g.prompt.push_back(20 + 31 * i + t);
    g.max_tokens = 12 + 3 * i;
    g.sampling.temperature = 0;
    ps.push_back(g);
    GenerateOptions o;
    o.max_new_tokens = g.max_tokens;
    o.sampling = g.sampling;
    o.stop_at_eos = StopAtEos::No;
    auto all = generate(*model_, g.prompt, o);
    want.emplace_back(all.begin() + int64_t(g.prompt.size()), all.end());
  }
  for (const int64_t step_tokens : {int64_t(0), int64_t(8)}) {
    SCOPED_TRACE(step_tokens ? "chunked prefill" : "whole prefill");
    serve::SchedulerOptions so;
    so.max_batch = 3;
    so.context = 64;
    so.cache_block = 8;
    so.max_step_tokens = step_tokens;
    so.speculate_mtp = true;
    so.draft_tokens = 3;
    serve::Scheduler s(*model_, so);
    int64_t checks = 0;
    for (size_t i = 0; i < ps.size(); ++i) {  // one at a time: each later one finds the earlier snapshots
      auto job = s.submit(ps[i]);
      std::vector<int64_t> got;
      for (int n = 0; n < 6000 && !job->poll(got, std::chrono::milliseconds(10));) ++n;
      EXPECT_EQ(got, want[i]) << "request " << i;
      if (i > 0) {
        EXPECT_GE(job->cached_tokens(), 16) << "request " << i;
      }
      const auto m = s.metrics();
      EXPECT_GT(m.spec_checks, checks) << "request " << i << " drafted nothing";
      checks = m.spec_checks;
    }
  }
  serve::SchedulerOptions bad;
  bad.speculate_mtp = true;
  bad.speculate_ngram = true;
  EXPECT_THROW(serve::Scheduler(*model_, bad), Error);
  auto plain = load_model(testing::fixture_model("deepseek-v3-tiny"));
  bad.speculate_ngram = false;
  EXPECT_THROW(serve::Scheduler(*plain, bad), Error);
}

TEST_F(Mtp, SpeculationWithoutTheLayerIsAClearError) {
  auto plain = load_model(testing::fixture_model("deepseek-v3-tiny"));
  GenerateOptions o;
  o.speculate.mtp = true;
  try {
    generate(*plain, {1, 2, 3}, o);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("MTP layer"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3
