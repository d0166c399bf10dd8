// GPT-2 on CUDA against transformers' outputs (fixtures/models/gpt2-tiny): logits of the full
// forward within 1e-4 relative L2 with fp32 weights (5e-3 with bf16 GEMM weights), and the greedy
// continuation (repeated full forwards) equal to the fixture's ids; training steps equal to the
// CPU's. Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "io/safetensors.h"
#include "models/gpt2.h"
#include "bench/harness/gpt2_cuda.h"
#include "models/registry.h"
#include "ops/autograd.h"
#include "train/optimizer.h"

namespace k3 {
namespace {

double rel(const std::vector<float>& x, const Tensor& ref) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    num += std::pow(double(x[size_t(i)]) - ref.f32()[i], 2);
    den += std::pow(double(ref.f32()[i]), 2);
  }
  return std::sqrt(num / den);
}

std::vector<int64_t> ids_of(const Tensor& t) {
  Tensor c = t.to(DType::F32);  // the fixture's ids are int64; small, exact in fp32
  std::vector<int64_t> out;
  for (int64_t i = 0; i < c.numel(); ++i) out.push_back(int64_t(c.f32()[i]));
  return out;
}

class Gpt2Cuda : public ::testing::TestWithParam<device::Storage> {};

TEST_P(Gpt2Cuda, LogitsAndGreedyIdsMatchTransformers) {
  const std::string dir = std::string(K3_SHARED_DIR) + "/fixtures/models/gpt2-tiny";
  auto model = load_model(dir);
  auto* gpt2 = dynamic_cast<Gpt2Model*>(model.get());
  ASSERT_NE(gpt2, nullptr);
  const bool bf16 = GetParam() == device::Storage::BF16;
  cuda::Gpt2Runner run(*gpt2, GetParam());
  SafeTensors ex = SafeTensors::open(dir + "/expected.safetensors");
  const Tensor input = ex.get("input_ids");  // [2, T]
  const int64_t B = input.dim(0), T = input.dim(1), V = model->vocab_size();
  const std::vector<int64_t> ids = ids_of(input);
  const std::vector<float> logits = run.logits(ids.data(), B, T);
  EXPECT_LE(rel(logits, ex.get_f32("logits")), bf16 ? 5e-3 : 1e-4);

  // Greedy continuation by repeated full forwards.
  std::vector<int64_t> seq = ids_of(ex.get("prompt_ids"));
  const std::vector<int64_t> want = ids_of(ex.get("greedy_ids"));
  while (seq.size() < want.size()) {
    const std::vector<float> lg = run.logits(seq.data(), 1, int64_t(seq.size()));
    const float* last = lg.data() + (seq.size() - 1) * size_t(V);
    seq.push_back(int64_t(std::max_element(last, last + V) - last));
  }
  EXPECT_EQ(seq, want);
}

// Training: five AdamW steps on the GPU against five on the CPU (autograd + train/optimizer.h's
// AdamW) from the same weights and batch: every loss within `loss_tol` relative, and the weights
// after the steps within `weight_tol` relative L2. Returns the largest loss gap.
double train_against_cpu(Model& cpu, Model& gpu_model, const std::vector<int64_t>& ids, int64_t B, int64_t T,
                         bool bf16_gemms, double loss_tol, double weight_tol) {
  auto* g2 = dynamic_cast<Gpt2Model*>(&gpu_model);
  EXPECT_NE(g2, nullptr);
  if (!g2) return INFINITY;
  cuda::Gpt2Runner run(*g2, device::Storage::F32);
  run.set_bf16_gemms(bf16_gemms);
  std::vector<int64_t> targets(ids.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      targets[size_t(b * T + t)] = t + 1 < T ? ids[size_t(b * T + t + 1)] : -1;
  AdamWOptions o;
  o.lr = 3e-3f;
  AdamW opt(o);
  cuda::Gpt2Runner::Adam adam;  // the same β, ε and decay as AdamWOptions' defaults
  adam.beta1 = o.beta1, adam.beta2 = o.beta2, adam.eps = o.eps, adam.weight_decay = o.weight_decay;
  double worst = 0.0;
  for (int step = 0; step < 5; ++step) {
    zero_grad(cpu);
    float cpu_loss = 0.0f;
    {
      Recording rec;
      Var l = cpu.loss(TokenBatch{ids.data(), B, T, nullptr}, targets);
      cpu_loss = l->value.f32()[0];
      backward(l);
    }
    opt.step(cpu, o.lr);
    const float gpu_loss = run.train_step(ids.data(), targets.data(), B, T, o.lr, adam);
    EXPECT_NEAR(gpu_loss, cpu_loss, loss_tol * std::fabs(cpu_loss)) << "step " << step;
    worst = std::max(worst, std::fabs(double(gpu_loss) - cpu_loss) / std::fabs(cpu_loss));
  }
  run.copy_to(*g2);
  double num = 0.0, den = 0.0;
  std::map<std::string, Tensor> want;
  cpu.visit([&](const std::string& name, Node& p, ParamKind) { want[name] = p.value; });
  gpu_model.visit([&](const std::string& name, Node& p, ParamKind) {
    const Tensor& w = want.at(name);
    for (int64_t i = 0; i < w.numel(); ++i) {
      num += std::pow(double(p.value.f32()[i]) - w.f32()[i], 2);
      den += std::pow(double(w.f32()[i]), 2);
    }
  });
  EXPECT_LE(std::sqrt(num / den), weight_tol);
  return worst;
}

// The gpt2-tiny fixture's weights and input ids.
double train_fixture_against_cpu(bool bf16_gemms, double loss_tol, double weight_tol) {
  const std::string dir = std::string(K3_SHARED_DIR) + "/fixtures/models/gpt2-tiny";
  auto cpu = load_model(dir), gpu = load_model(dir);
  SafeTensors ex = SafeTensors::open(dir + "/expected.safetensors");
  const Tensor input = ex.get("input_ids");
  return train_against_cpu(*cpu, *gpu, ids_of(input), input.dim(0), input.dim(1), bf16_gemms, loss_tol, weight_tol);
}

TEST(Gpt2CudaTrain, StepsMatchCpu) { train_fixture_against_cpu(false, 1e-4, 1e-3); }

// A vocabulary that is not a multiple of 64 (GPT-2's 50,257 is not): the runner pads wte's rows
// and the logits' columns; losses and weights (wte's real rows) still follow the CPU.
TEST(Gpt2CudaTrain, PaddedVocabularyStepsMatchCpu) {
  const std::string dir = std::string(K3_SHARED_DIR) + "/fixtures/models/gpt2-tiny";
  auto fixture = load_model(dir);
  Gpt2Config c = dynamic_cast<const Gpt2Model&>(*fixture).config();
  c.vocab_size = 301;
  Gpt2Model cpu(c), gpu(c);
  cpu.init_random(5);
  gpu.init_random(5);
  const int64_t B = 2, T = 37;
  std::vector<int64_t> ids(size_t(B * T));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((i * 131 + 7) % 301);
  train_against_cpu(cpu, gpu, ids, B, T, false, 1e-4, 1e-3);
}

// Mixed precision (every GEMM's operands in bf16, fp32 accumulation and master weights): within
// the bf16 tolerance of the fp32 CPU, and visibly not fp32 (the bf16 path runs).
TEST(Gpt2CudaTrain, Bf16GemmStepsStayCloseToCpu) {
  const double worst = train_fixture_against_cpu(true, 1e-2, 2e-2);
  EXPECT_GT(worst, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Weights, Gpt2Cuda, ::testing::Values(device::Storage::F32, device::Storage::BF16),
                         [](const ::testing::TestParamInfo<device::Storage>& p) {
                           return std::string(p.param == device::Storage::BF16 ? "bf16" : "f32");
                         });

}  // namespace
}  // namespace k3
