// Every fixture model (fixtures/models, made with transformers) with its weights on the GPU
// (move_to, the ops' CUDA forms): logits within 1e-4 relative L2 of the reference, and the
// greedy continuation, by repeated full forwards, equal to the reference ids; decode over device
// memories equal to the full forward; bf16 latent caches within their rounding. Needs a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "infer/generate.h"
#include "mixers/mixers_cuda.h"
#include "mixers/mla/mla.h"
#include "models/mtp.h"
#include "models/registry.h"
#include "models/testing.h"
#include "ops/ag.h"

namespace k3 {

using testing::fixture_model;
using testing::rel_l2;

class FixtureModelCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureModelCuda, LogitsAndGreedyIdsMatchTheReference) {
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA);
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor ids = expected.get("input_ids");   // [B, T]
  Tensor ref = expected.get_f32("logits");  // [B, T, V]
  const int64_t B = ids.dim(0), T = ids.dim(1), V = model->vocab_size();
  std::vector<float> out(static_cast<size_t>(B * T * V));
  model->logits(TokenBatch{ids.data<int64_t>(), B, T, nullptr}, out.data(), Logits::All);
  EXPECT_LT(rel_l2(out.data(), ref.f32(), B * T * V), 1e-4);

  Tensor prompt = expected.get("prompt_ids"), greedy = expected.get("greedy_ids");
  std::vector<int64_t> seq(prompt.data<int64_t>(), prompt.data<int64_t>() + prompt.numel());
  const std::vector<int64_t> want(greedy.data<int64_t>(), greedy.data<int64_t>() + greedy.numel());
  // By repeated full forwards, and by k3::generate over a device context.
  std::vector<float> last(static_cast<size_t>(V));
  GenerateOptions g;
  g.max_new_tokens = int64_t(want.size() - seq.size());
  g.sampling.temperature = 0;
  g.stop_at_eos = StopAtEos::No;
  EXPECT_EQ(generate(*model, seq, g), want);
  while (seq.size() < want.size()) {
    model->forward(seq.data(), int64_t(seq.size()), nullptr, last.data(), Logits::Last);
    seq.push_back(int64_t(std::max_element(last.begin(), last.end()) - last.begin()));
  }
  EXPECT_EQ(seq, want);
}

// Device memories (mixers_cuda.h): a 5-token prefill into a context, then one token at a time,
// equals the full forward, and the reference.
TEST_P(FixtureModelCuda, DecodeOverDeviceMemoriesEqualsPrefill) {
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA);
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor greedy = expected.get("greedy_ids");
  const int64_t T = greedy.numel(), V = model->vocab_size();
  const int64_t* ids = greedy.data<int64_t>();
  std::vector<float> full(static_cast<size_t>(T * V)), step(static_cast<size_t>(T * V));
  model->forward(ids, T, nullptr, full.data(), Logits::All);
  EXPECT_LT(rel_l2(full.data(), expected.get_f32("greedy_logits").f32(), T * V), 1e-4);
  Context ctx = model->new_context(T);
  model->forward(ids, 5, &ctx, step.data(), Logits::All);
  for (int64_t t = 5; t < T; ++t) model->forward(ids + t, 1, &ctx, step.data() + t * V, Logits::Last);
  EXPECT_LT(rel_l2(step.data(), full.data(), T * V), 1e-5);
  EXPECT_EQ(ctx.position, T);
  // A snapshot restores: the last 3 tokens again from a copy taken before them.
  Context again = model->new_context(T);
  model->forward(ids, T - 3, &again, step.data(), Logits::All);
  Context snap = again.clone();
  for (int64_t t = T - 3; t < T; ++t) model->forward(ids + t, 1, &again, step.data(), Logits::Last);
  for (size_t l = 0; l < again.layers.size(); ++l) again.layers[l]->restore(*snap.layers[l]);
  again.position = snap.position;
  for (int64_t t = T - 3; t < T; ++t) model->forward(ids + t, 1, &again, step.data() + t * V, Logits::Last);
  EXPECT_LT(rel_l2(step.data() + (T - 3) * V, full.data() + (T - 3) * V, 3 * V), 1e-5);
}

// Decoder (picks): after one eager step the step is captured as a CUDA graph and replayed. Two
// sequences (the reference prompt, and the same prompt less its last two tokens) continue
// together: the first must give the reference's greedy ids, both the ids of the same steps
// queued from the host (Model::greedy), and the memories they leave must give the same logits
// for one more token. Every fixture model's step replays, gpt2-tiny's over its KV caches too.
TEST_P(FixtureModelCuda, DecoderReplaysMatchTheReference) {
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA);
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor prompt = expected.get("prompt_ids"), greedy = expected.get("greedy_ids");
  const int64_t P = prompt.numel(), N = greedy.numel() - P, V = model->vocab_size();
  const int64_t* want = greedy.data<int64_t>();
  const int64_t lens[2] = {P, P - 2};
  std::vector<Context> graphed, queued;
  std::vector<int64_t> first(2);
  std::vector<float> last(static_cast<size_t>(V));
  for (int run = 0; run < 2; ++run)
    for (int b = 0; b < 2; ++b) {
      std::vector<Context>& cs = run ? queued : graphed;
      cs.push_back(model->new_context(P + N + 8));
      model->forward(prompt.data<int64_t>(), lens[b], &cs.back(), last.data(), Logits::Last);
      first[size_t(b)] = int64_t(std::max_element(last.begin(), last.end()) - last.begin());
    }
  ASSERT_EQ(first[0], want[P]);
  std::vector<Context*> gp = {&graphed[0], &graphed[1]}, qp = {&queued[0], &queued[1]};
  Decoder decoder(*model, gp);
  std::vector<int64_t> g_ids = first, q_ids = first, g_next(2), q_next(2);
  for (int64_t t = 1; t < N; ++t) {
    decoder.step(g_ids.data(), g_next.data());
    model->greedy(TokenBatch{q_ids.data(), 2, 1, qp.data()}, q_next.data());
    EXPECT_EQ(g_next[0], want[P + t]) << "step " << t;
    EXPECT_EQ(g_next, q_next) << "step " << t;
    g_ids = g_next, q_ids = q_next;
  }
  EXPECT_TRUE(decoder.replaying()) << decoder.refusal();
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(graphed[size_t(b)].position, queued[size_t(b)].position);
    for (size_t l = 0; l < graphed[size_t(b)].layers.size(); ++l)
      EXPECT_EQ(graphed[size_t(b)].layers[l]->length(), queued[size_t(b)].layers[l]->length()) << "layer " << l;
    std::vector<float> lg(static_cast<size_t>(V)), lq(static_cast<size_t>(V));
    model->forward(&g_ids[size_t(b)], 1, &graphed[size_t(b)], lg.data(), Logits::Last);
    model->forward(&q_ids[size_t(b)], 1, &queued[size_t(b)], lq.data(), Logits::Last);
    EXPECT_LT(rel_l2(lg.data(), lq.data(), V), 1e-6) << "sequence " << b;
  }
  // Those forwards moved the contexts outside the decoder: its next steps capture again, and
  // still equal the queued ones.
  for (int t = 0; t < 3; ++t) {
    decoder.step(g_ids.data(), g_next.data());
    model->greedy(TokenBatch{q_ids.data(), 2, 1, qp.data()}, q_next.data());
    EXPECT_EQ(g_next, q_next) << "after the outside forward, step " << t;
    g_ids = g_next, q_ids = q_next;
  }
  EXPECT_TRUE(decoder.replaying()) << decoder.refusal();
  EXPECT_EQ(graphed[0].position, queued[0].position);
  // A token outside the vocabulary is refused before the replay, as the queued step refuses it.
  const int64_t bad[2] = {V, 0};
  EXPECT_THROW(decoder.step(bad, g_next.data()), Error);
  // Memories replaced by clones (the same counts, other device arrays): captured again.
  graphed[1] = graphed[1].clone();
  queued[1] = queued[1].clone();
  for (int t = 0; t < 2; ++t) {
    decoder.step(g_ids.data(), g_next.data());
    model->greedy(TokenBatch{q_ids.data(), 2, 1, qp.data()}, q_next.data());
    EXPECT_EQ(g_next, q_next) << "after the clones, step " << t;
    g_ids = g_next, q_ids = q_next;
  }
  EXPECT_EQ(graphed[1].position, queued[1].position);
}

// Decoder (logits, for samplers): the replayed steps' logits of two sequences (the reference
// prompt and the same prompt less its last two tokens) equal the same steps queued from the host
// (Model::logits over contexts fed the same ids).
TEST_P(FixtureModelCuda, LogitsDecoderReplaysMatchTheQueuedSteps) {
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA);
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor prompt = expected.get("prompt_ids");
  const int64_t P = prompt.numel(), V = model->vocab_size(), steps = 6;
  const int64_t lens[2] = {P, P - 2};
  std::vector<Context> graphed, queued;
  std::vector<float> last(static_cast<size_t>(V));
  std::vector<int64_t> ids(2);
  for (int run = 0; run < 2; ++run)
    for (int b = 0; b < 2; ++b) {
      std::vector<Context>& cs = run ? queued : graphed;
      cs.push_back(model->new_context(P + steps + 4));
      model->forward(prompt.data<int64_t>(), lens[b], &cs.back(), last.data(), Logits::Last);
      ids[size_t(b)] = int64_t(std::max_element(last.begin(), last.end()) - last.begin());
    }
  std::vector<Context*> gp = {&graphed[0], &graphed[1]}, qp = {&queued[0], &queued[1]};
  Decoder decoder(*model, gp, true, Decoder::Output::Logits);
  std::vector<float> got(static_cast<size_t>(2 * V)), want(static_cast<size_t>(2 * V));
  for (int64_t t = 0; t < steps; ++t) {
    decoder.step(ids.data(), got.data());
    model->logits(TokenBatch{ids.data(), 2, 1, qp.data()}, want.data(), Logits::Last);
    for (int b = 0; b < 2; ++b) {
      EXPECT_LT(rel_l2(got.data() + b * V, want.data() + b * V, V), 1e-5) << "step " << t << ", sequence " << b;
      // The next ids: the queued logits' second-best token, so that the ids differ from greedy's.
      std::vector<int64_t> order(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v) order[size_t(v)] = v;
      const float* row = want.data() + b * V;
      std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](int64_t x, int64_t y) { return row[x] > row[y]; });
      ids[size_t(b)] = order[1];
    }
  }
  EXPECT_TRUE(decoder.replaying()) << decoder.refusal();
  for (int b = 0; b < 2; ++b) EXPECT_EQ(graphed[size_t(b)].position, queued[size_t(b)].position);
}

// Two sequences of different lengths decoded together (one batch of B = 2, T = 1) over device
// memories, against the same steps on the CPU.
TEST_P(FixtureModelCuda, BatchedDecodeOfUnequalSequencesMatchesTheCpu) {
  auto model = load_model(fixture_model(GetParam()));
  const int64_t V = model->vocab_size();
  std::vector<std::vector<float>> got[2];
  got[0] = testing::unequal_batched_decode(*model, 3);
  move_to(*model, Device::CUDA);
  got[1] = testing::unequal_batched_decode(*model, 3);
  for (size_t i = 0; i < got[0].size(); ++i)
    EXPECT_LT(rel_l2(got[1][i].data(), got[0][i].data(), 2 * V), 1e-4) << "step " << i;
}

// bf16 GEMM weights (move_to's DType::BF16): the logits stay within 5e-3 of the reference, or
// within 2.5x the error of the CPU model whose same weights are rounded to bf16 (exact fp32
// arithmetic on the rounded weights), whichever is larger.
TEST_P(FixtureModelCuda, Bf16GemmWeightsStayWithinTheirRoundingError) {
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor ids = expected.get("input_ids");
  Tensor ref = expected.get_f32("logits");
  const int64_t B = ids.dim(0), T = ids.dim(1);
  auto rounded = load_model(fixture_model(GetParam()));
  int64_t converted = 0;
  rounded->visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (!bf16_gemm_weight(name, p.value, kind)) return;
    ++converted;
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] = round_to_bf16(p.value.f32()[i]);
  });
  EXPECT_GT(converted, 0);
  const int64_t V = rounded->vocab_size();
  std::vector<float> cpu(static_cast<size_t>(B * T * V)), gpu(cpu.size());
  rounded->logits(TokenBatch{ids.data<int64_t>(), B, T, nullptr}, cpu.data(), Logits::All);
  const double e_cpu = rel_l2(cpu.data(), ref.f32(), B * T * V);
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA, DType::BF16);
  model->logits(TokenBatch{ids.data<int64_t>(), B, T, nullptr}, gpu.data(), Logits::All);
  const double e_gpu = rel_l2(gpu.data(), ref.f32(), B * T * V);
  EXPECT_LT(e_gpu, std::max(5e-3, 2.5 * e_cpu)) << "bf16-rounded weights on the CPU: " << e_cpu;
  std::printf("%s bf16 GEMM weights: rel L2 %.2e (CPU with the same rounding %.2e)\n", GetParam().c_str(), e_gpu, e_cpu);
}

// bf16 latent caches (LatentStorage): a 5-token prefill then one token at a time stays within
// 5e-3 of the reference logits, k3::generate still gives the reference's greedy ids, and every
// latent cache takes half the bytes of its fp32 form (models without MLA layers are unchanged).
TEST_P(FixtureModelCuda, Bf16LatentCachesStayNearTheReference) {
  auto model = load_model(fixture_model(GetParam()));
  move_to(*model, Device::CUDA);
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor prompt = expected.get("prompt_ids"), greedy = expected.get("greedy_ids");
  const int64_t T = greedy.numel(), V = model->vocab_size();
  const int64_t* ids = greedy.data<int64_t>();
  Context f32 = model->new_context(T);
  LatentStorage bf16(DType::BF16);
  Context ctx = model->new_context(T);
  ASSERT_EQ(ctx.layers.size(), f32.layers.size());
  for (size_t l = 0; l < ctx.layers.size(); ++l)
    EXPECT_EQ(ctx.layers[l]->bytes() * (ctx.layers[l]->kind() == MemoryKind::LatentCache ? 2 : 1),
              f32.layers[l]->bytes())
        << "layer " << l;
  std::vector<float> step(static_cast<size_t>(T * V));
  model->forward(ids, 5, &ctx, step.data(), Logits::All);
  for (int64_t t = 5; t < T; ++t) model->forward(ids + t, 1, &ctx, step.data() + t * V, Logits::Last);
  const double e = rel_l2(step.data(), expected.get_f32("greedy_logits").f32(), T * V);
  EXPECT_LT(e, 5e-3);
  std::printf("%s decode over bf16 latent caches: rel L2 %.2e\n", GetParam().c_str(), e);
  std::vector<int64_t> seq(prompt.data<int64_t>(), prompt.data<int64_t>() + prompt.numel());
  GenerateOptions g;
  g.max_new_tokens = T - int64_t(seq.size());
  g.sampling.temperature = 0;
  g.stop_at_eos = StopAtEos::No;
  EXPECT_EQ(generate(*model, seq, g), std::vector<int64_t>(ids, ids + T));
}

// The mean next-token cross-entropy (k3 eval's loss) on the device equals the CPU's.
TEST_P(FixtureModelCuda, LossMatchesTheCpu) {
  auto model = load_model(fixture_model(GetParam()));
  SafeTensors expected = SafeTensors::open(fixture_model(GetParam()) + "/expected.safetensors");
  Tensor ids = expected.get("input_ids");
  const int64_t B = ids.dim(0), T = ids.dim(1);
  std::vector<int64_t> targets(static_cast<size_t>(B * T));
  for (int64_t i = 0; i < B * T; ++i) targets[size_t(i)] = i % T == T - 1 ? -1 : ids.data<int64_t>()[i + 1];
  const TokenBatch batch{ids.data<int64_t>(), B, T, nullptr};
  const double cpu = model->loss(batch, targets)->value.f32()[0];
  move_to(*model, Device::CUDA);
  const double gpu = model->loss(batch, targets)->value.f32()[0];
  EXPECT_NEAR(gpu, cpu, 1e-5 * std::fabs(cpu)) << "cpu " << cpu << " cuda " << gpu;
}

TEST_P(FixtureModelCuda, AHostContextOnADeviceModelIsAClearError) {
  auto model = load_model(fixture_model(GetParam()));
  Context host = model->new_context(8);
  move_to(*model, Device::CUDA);
  const int64_t ids[2] = {1, 2};
  std::vector<float> out(static_cast<size_t>(model->vocab_size()));
  try {
    model->forward(ids, 2, &host, out.data(), Logits::Last);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureModelCuda,
                         ::testing::Values("gpt2-tiny", "deepseek-v3-tiny", "kimi-linear-tiny", "kimi-k3-tiny",
                                           "qwen3-next-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });

// deepseek-v3-tiny's multi-token-prediction layer on the GPU: its logits match transformers'
// (tests/data/mtp, as models/mtp_test.cc checks on the CPU), and greedy generation drafting with it
// equals plain greedy generation.
TEST(MtpCuda, LogitsMatchTransformersAndGreedyOutputIsKept) {
  const std::string dir = testing::checkpoint_with_mtp();
  auto model = load_model(dir);
  std::filesystem::remove_all(dir);
  move_to(*model, Device::CUDA);
  ASSERT_NE(model->mtp(), nullptr);
  const SafeTensors gold = SafeTensors::open(testing::mtp_golden());
  const Tensor idt = gold.get("ids");
  const std::vector<int64_t> t(idt.data<int64_t>(), idt.data<int64_t>() + idt.numel());
  const int64_t T = int64_t(t.size());
  const MtpHead& head = *model->mtp();
  const Var h = model->hidden(TokenBatch{t.data(), 1, T - 1, nullptr});
  Context ctx = head.new_context(T);
  const Var o = head.forward(h, std::vector<int64_t>(t.begin() + 1, t.end()), &ctx);
  const Tensor got = ag::linear(head.norm()(o), head.head(), nullptr, WeightLayout::OutIn)->value.to_device(Device::CPU);
  const Tensor want = gold.get("mtp_logits");
  ASSERT_EQ(got.numel(), want.numel());
  EXPECT_LT(rel_l2(got.f32(), want.f32(), got.numel()), 1e-4);

  const std::vector<int64_t> prompt = {3, 17, 250, 41, 99};
  GenerateOptions g;
  g.max_new_tokens = 40;
  g.sampling.temperature = 0;
  g.stop_at_eos = StopAtEos::No;
  const auto plain = generate(*model, prompt, g);
  g.speculate.mtp = true;
  g.speculate.draft_tokens = 3;
  GenerateStats st;
  EXPECT_EQ(generate(*model, prompt, g, {}, &st), plain);
  EXPECT_GT(st.drafted, 0);
}

}  // namespace k3
