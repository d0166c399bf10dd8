// Training on CUDA against training on the CPU: every trainable tiny preset, the same init and
// the same batches, 12 AdamW steps with clipping, the MoE balance loss and bias update on each
// device. The losses of every step agree within 1e-3 relative and the final parameters within
// 5e-3 (fp32 on both; the CPU path is the one the fixtures and finite differences test). Needs
// a GPU: label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "core/random.h"
#include "models/model.h"
#include "models/presets.h"
#include "models/registry.h"
#include "ops/ag.h"
#include "ops/ag_cuda.h"
#include "train/optimizer.h"

namespace k3 {
namespace {

struct TrainRun {
  std::vector<double> losses;
  std::unique_ptr<Model> model;
};

TrainRun train(const std::string& preset, Device device, bool bf16 = false) {
  TrainRun r;
  r.model = build_model(preset_config(preset), preset);
  r.model->init_random(5);
  if (device == Device::CUDA) move_to(*r.model, Device::CUDA);
  const int64_t B = 3, T = 32, V = r.model->vocab_size();
  AdamWOptions o;
  o.lr = 3e-3f;
  AdamW opt(o);
  Rng rng(17);
  std::vector<int64_t> ids(size_t(B * T)), targets(ids.size());
  for (int step = 0; step < 12; ++step) {
    for (auto& t : ids) t = int64_t(rng.below(uint64_t(std::min<int64_t>(V, 300))));
    for (size_t i = 0; i < ids.size(); ++i) targets[i] = (i + 1) % size_t(T) == 0 ? -1 : ids[(i + 1) % ids.size()];
    zero_grad(*r.model);
    Var l;
    {
      Recording rec;
      std::optional<ag::gpu::Bf16Gemms> autocast;
      if (bf16) autocast.emplace();
      l = r.model->loss(TokenBatch{ids.data(), B, T, nullptr}, targets);
      Var total = l;
      if (Var aux = r.model->aux_loss(T, 0.01f)) total = ag::add(l, aux);  // MoE presets: the balance loss too
      backward(total);
    }
    r.losses.push_back(l->value.to_device(Device::CPU).f32()[0]);
    clip_grad_norm(*r.model, 0.5);  // small enough to clip: the device norm path scales too
    opt.step(*r.model, o.lr);
    r.model->after_step();
  }
  return r;
}

class TrainCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainCuda, LossesAndParametersMatchTheCpu) {
  const TrainRun cpu = train(GetParam(), Device::CPU), gpu = train(GetParam(), Device::CUDA);
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-3 * std::abs(cpu.losses[i])) << GetParam() << " step " << i;
  EXPECT_LT(cpu.losses.back(), cpu.losses.front()) << "the reference run does not learn";
  double num = 0, den = 0;
  std::vector<Tensor> ref;
  cpu.model->visit([&](const std::string&, Node& p, ParamKind) { ref.push_back(p.value); });
  size_t i = 0;
  gpu.model->visit([&](const std::string& name, Node& p, ParamKind) {
    const Tensor got = p.value.to_device(Device::CPU);
    ASSERT_EQ(got.shape(), ref[i].shape()) << name;
    for (int64_t j = 0; j < got.numel(); ++j) {
      num += std::pow(double(got.f32()[j]) - ref[i].f32()[j], 2);
      den += std::pow(double(ref[i].f32()[j]), 2);
    }
    ++i;
  });
  EXPECT_LT(std::sqrt(num / den), 5e-3) << GetParam();  // AdamW divides by √v: fp32 noise in tiny gradients moves their weights
}

// Mixed precision (bf16 GEMM operands, fp32 accumulation and master weights): the losses stay
// within 1e-2 relative of the fp32 CPU run over the 12 steps.
TEST_P(TrainCuda, Bf16GemmLossesStayCloseToTheCpu) {
  const TrainRun cpu = train(GetParam(), Device::CPU), gpu = train(GetParam(), Device::CUDA, true);
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-2 * std::abs(cpu.losses[i])) << GetParam() << " step " << i;
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainCuda,
                         ::testing::Values("gpt2-tiny", "linear-tiny", "deltanet-tiny", "gdn-tiny", "kda-tiny",
                                           "kimi-linear-tiny", "k3-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace k3
