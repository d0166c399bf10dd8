// MLA on the GPU (weights moved to the device, mixers_cuda.h's latent cache and split latent
// attention) against the CPU layer: the expanded prefill, and the absorbed decode continuing a
// context long enough that the latent rows are split across many blocks, and at DeepSeek/K3's
// latent width with more heads than one block holds, and at widths taken by each kernel; batched
// sequences at different lengths.
// Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/random.h"
#include "mixers/mla.h"

namespace k3 {
namespace {

void init(const Mixer& m, uint64_t seed) {
  Rng rng(seed);
  m.visit("", [&](const std::string&, Node& p, ParamKind k) {
    p.value = Tensor::empty(p.value.shape());
    for (int64_t i = 0; i < p.value.numel(); ++i)
      p.value.f32()[i] = k == ParamKind::Norm ? 1.0f + 0.1f * rng.normal() : 0.2f * rng.normal();
  });
}
void to_device(const Mixer& m, Device d) {
  m.visit("", [&](const std::string&, Node& p, ParamKind) { p.value = p.value.to_device(d); });
}
Tensor random_rows(int64_t rows, int64_t cols, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty({rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.normal();
  return t;
}
double rel(const Tensor& a, const Tensor& b) {
  double n = 0, d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    n += std::pow(double(a.f32()[i]) - b.f32()[i], 2);
    d += std::pow(double(b.f32()[i]), 2);
  }
  return std::sqrt(n / d);
}

// Prefill through the caches (sequences of `lens` tokens), 3 batched decode steps, and the expanded
// (no-cache) prefill, on the CPU and on the GPU; every output within 1e-4.
void compare_cpu_and_gpu(const MlaOptions& o, const std::vector<int64_t>& lens) {
  Mla m(o);
  init(m, 5);
  const int64_t D = o.d_model, B = int64_t(lens.size());
  std::vector<Tensor> cpu_out, gpu_out;
  for (Device d : {Device::CPU, Device::CUDA}) {
    to_device(m, d);
    std::vector<std::unique_ptr<Memory>> mems;
    std::vector<Memory*> all;
    for (size_t b = 0; b < lens.size(); ++b) {
      mems.push_back(m.new_memory(1024));
      all.push_back(mems.back().get());
      Memory* one[1] = {mems.back().get()};
      Tensor x = random_rows(lens[b], D, 100 + b).to_device(d);
      Var y = m.forward(constant(x), SeqBatch{1, lens[b], one});
      (d == Device::CPU ? cpu_out : gpu_out).push_back(y->value.to_device(Device::CPU));
    }
    for (int step = 0; step < 3; ++step) {
      Tensor x = random_rows(B, D, 900 + uint64_t(step)).to_device(d);
      Var y = m.forward(constant(x), SeqBatch{B, 1, all.data()});
      (d == Device::CPU ? cpu_out : gpu_out).push_back(y->value.to_device(Device::CPU));
    }
    Tensor x = random_rows(2 * 40, D, 7).to_device(d);
    (d == Device::CPU ? cpu_out : gpu_out).push_back(m.forward(constant(x), SeqBatch{2, 40, nullptr})->value.to_device(Device::CPU));
  }
  to_device(m, Device::CPU);
  ASSERT_EQ(cpu_out.size(), gpu_out.size());
  for (size_t i = 0; i < cpu_out.size(); ++i) EXPECT_LT(rel(gpu_out[i], cpu_out[i]), 1e-4) << "output " << i;
}

class MlaCuda : public ::testing::TestWithParam<MlaPosition> {};

// A small latent (48 + 8) over 700 and 300 cached tokens: many splits of the latent rows.
TEST_P(MlaCuda, PrefillAndLongAbsorbedDecodeMatchTheCpu) {
  MlaOptions o;
  o.d_model = 64;
  o.heads = 4;
  o.q_lora_rank = 24;
  o.kv_lora_rank = 48;
  o.qk_nope_head_dim = 16;
  o.qk_rope_head_dim = 8;
  o.v_head_dim = 12;
  o.position = GetParam();
  o.gate = OutputGate::Sigmoid;
  compare_cpu_and_gpu(o, {700, 300});
}

// DeepSeek/K3's latent width (512 + 64) with 40 heads: three head groups per block row, 16
// accumulator columns per lane.
TEST_P(MlaCuda, FullWidthLatentWithManyHeadsMatchesTheCpu) {
  MlaOptions o;
  o.d_model = 96;
  o.heads = 40;
  o.q_lora_rank = 32;
  o.kv_lora_rank = 512;
  o.qk_nope_head_dim = 16;
  o.qk_rope_head_dim = 64;
  o.v_head_dim = 16;
  o.position = GetParam();
  compare_cpu_and_gpu(o, {150, 90});
}

// Every decode kernel, with scalar copies (widths no multiple of 4; zero columns up to the next
// multiple of 8) and 16-byte ones: 20 heads (a second, partial head group) at 45 + 6 (narrow, two
// head tiles) and 101 + 6 (wide); 6 heads at 101 + 6 and at k3-small's 96 + 32 (narrow up to 128);
// 4 heads at 45 + 6 and at 36 + 4 (narrow, one head tile; a rank whose last m16 tile reaches past
// the width); 12 heads at 48 + 16 (two head tiles).
TEST_P(MlaCuda, LatentWidthsOfEveryKernelMatchTheCpu) {
  struct Case {
    int64_t rank, rope, heads;
  };
  for (const Case& c : {Case{45, 6, 20}, Case{101, 6, 20}, Case{101, 6, 6}, Case{96, 32, 6}, Case{45, 6, 4},
                        Case{36, 4, 4}, Case{48, 16, 12}}) {
    SCOPED_TRACE("kv_lora_rank " + std::to_string(c.rank) + " + " + std::to_string(c.rope) + ", " +
                 std::to_string(c.heads) + " heads");
    MlaOptions o;
    o.d_model = 48;
    o.heads = c.heads;
    o.q_lora_rank = 24;
    o.kv_lora_rank = c.rank;
    o.qk_nope_head_dim = 8;
    o.qk_rope_head_dim = c.rope;
    o.v_head_dim = 8;
    o.position = GetParam();
    compare_cpu_and_gpu(o, {333, 64});
  }
}

INSTANTIATE_TEST_SUITE_P(Positions, MlaCuda, ::testing::Values(MlaPosition::NoPE, MlaPosition::Rope));

}  // namespace
}  // namespace k3
