// Every trainable preset (tiny versions) can memorise one fixed batch: loss < 0.1. This is the
// end-to-end check that every model's backward is wired (a missing gradient path stalls it).
#include <gtest/gtest.h>

#include "core/random.h"
#include "models/presets.h"
#include "models/registry.h"
#include "ops/ag.h"
#include "train/optimizer.h"

namespace k3 {

class Overfit : public ::testing::TestWithParam<std::string> {};

TEST_P(Overfit, OneBatchToLossBelowPointOne) {
  Json cfg = preset_config(GetParam());
  auto model = build_model(cfg, GetParam());
  model->init_random(3);
  const int64_t B = 2, T = 24, V = model->vocab_size();
  Rng rng(11);
  std::vector<int64_t> ids(static_cast<size_t>(B * T)), targets(ids.size());
  for (auto& t : ids) t = int64_t(rng.below(uint64_t(std::min<int64_t>(V, 200))));
  for (size_t i = 0; i < ids.size(); ++i) targets[i] = (i + 1) % size_t(T) == 0 ? -1 : ids[i + 1];
  AdamWOptions o;
  // The wider -small presets take smaller steps: at 1e-2 GPT-2's needed 172 steps (1.6 minutes on
  // two cores), at 3e-3 14.
  o.lr = GetParam().ends_with("-small") ? 3e-3f : 1e-2f;
  o.weight_decay = 0.0f;
  AdamW opt(o);
  double loss = 1e9;
  int step = 0;
  for (; step < 400 && loss >= 0.1; ++step) {
    zero_grad(*model);
    Recording rec;
    Var l = model->loss(TokenBatch{ids.data(), B, T, nullptr}, targets);
    backward(l);
    loss = l->value.f32()[0];
    clip_grad_norm(*model, 1.0);
    opt.step(*model, step < 10 ? o.lr * float(step + 1) / 10 : o.lr);
    model->after_step();
  }
  EXPECT_LT(loss, 0.1) << GetParam() << " after " << step << " steps";
}

INSTANTIATE_TEST_SUITE_P(Presets, Overfit,
                         ::testing::Values("gpt2-tiny", "linear-tiny", "deltanet-tiny", "gdn-tiny", "kda-tiny",
                                           "kimi-linear-tiny", "k3-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });

// The -small presets (14-48M parameters) too; not in sanitizer builds, where they would take
// minutes (the main build runs them).
#if !defined(__SANITIZE_ADDRESS__)
INSTANTIATE_TEST_SUITE_P(SmallPresets, Overfit,
                         ::testing::Values("gpt2-small", "linear-small", "deltanet-small", "gdn-small", "kda-small",
                                           "kimi-linear-small", "k3-small"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });
#endif

}  // namespace k3

namespace k3 {

TEST(AuxLoss, MoeModelsExposeTheSequenceBalanceLoss) {
  auto model = build_model(preset_config("k3-tiny"), "k3-tiny");
  model->init_random(5);
  const int64_t B = 2, T = 16;
  std::vector<int64_t> ids(static_cast<size_t>(B * T)), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(i * 7 % 300), targets[i] = int64_t(i * 11 % 300);
  zero_grad(*model);
  Recording rec;
  Var l = model->loss(TokenBatch{ids.data(), B, T, nullptr}, targets);
  Var aux = model->aux_loss(T, 1e-2f);
  ASSERT_TRUE(aux);
  EXPECT_GT(aux->value.f32()[0], 0.0f);
  backward(ag::add(l, aux));
  bool router_grad = false;
  model->visit([&](const std::string& name, Node& p, ParamKind) {
    if (name.ends_with("block_sparse_moe.gate.weight") && p.grad.defined()) router_grad = true;
  });
  EXPECT_TRUE(router_grad);
  EXPECT_FALSE(build_model(preset_config("gpt2-tiny"), "gpt2-tiny")->aux_loss(T, 1e-2f));
}

}  // namespace k3
