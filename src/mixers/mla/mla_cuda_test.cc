// MLA on the GPU (weights moved to the device, mixers_cuda.h's latent cache and split latent
// attention) against the CPU layer: the expanded prefill, and the absorbed decode continuing a
// context long enough that the latent rows are split across many blocks, and at DeepSeek/K3's
// latent width with more heads than one block holds, and at widths taken by each kernel; batched
// sequences at different lengths. The kernels over fp32 and bf16 latent rows against a
// double-precision reference over the same (rounded) rows, and the layer with a bf16 latent cache
// against the fp32 CPU layer within bf16's rounding.
// Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "mixers/mixers_cuda.h"
#include "mixers/mla/mla.h"

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
void compare_cpu_and_gpu(const MlaOptions& o, const std::vector<int64_t>& lens, double tol = 1e-4) {
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
  for (size_t i = 0; i < cpu_out.size(); ++i) EXPECT_LT(rel(gpu_out[i], cpu_out[i]), tol) << "output " << i;
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

// The layer with bf16 latent caches (prefill through the caches and batched decode) against the
// fp32 CPU layer: the cache's rounding (2^-9 relative) is the only difference, so outputs agree to
// about 1e-3; DeepSeek/K3's width with two head groups and k3-small's narrow latent.
TEST_P(MlaCuda, Bf16LatentCacheStaysWithinItsRounding) {
  LatentStorage bf16(DType::BF16);
  for (const int64_t rank : {512, 96}) {
    SCOPED_TRACE("kv_lora_rank " + std::to_string(rank));
    MlaOptions o;
    o.d_model = 64;
    o.heads = rank == 512 ? 20 : 6;
    o.q_lora_rank = 24;
    o.kv_lora_rank = rank;
    o.qk_nope_head_dim = 16;
    o.qk_rope_head_dim = rank == 512 ? 64 : 32;
    o.v_head_dim = 16;
    o.position = GetParam();
    compare_cpu_and_gpu(o, {300, 77}, 1e-2);
    Mla m(o);
    init(m, 5);
    to_device(m, Device::CUDA);
    EXPECT_EQ(m.new_memory(100)->bytes(), size_t(100 * (o.kv_lora_rank + o.qk_rope_head_dim) * 2));
  }
}

INSTANTIATE_TEST_SUITE_P(Positions, MlaCuda, ::testing::Values(MlaPosition::NoPE, MlaPosition::Rope));

// k3::cuda::latent_attention over latent rows stored as `st` against a double-precision softmax
// attention over the same rows (rounded to bf16 first for a bf16 cache): B sequences with p0s
// cached rows, T new tokens each. Returns the relative L2 error of ob. With `climb`, the last
// (rope) column of q is 1 and that of row s is 200·((s / 64) mod 3): every third 64-row tile's
// scores rise by about 12 (log₂ units) over the tile before, so each head's running maximum moves
// by more than the warpgroup kernel's slack in the middle of a chunk, and what was summed before
// must be rescaled. (The column lies outside ob's R, and the rows that dominate each softmax share
// its value, so the scores' rounding of it does not show in ob.)
double latent_attention_error(device::Storage st, int64_t R, int64_t rope, int64_t H, int64_t T,
                              const std::vector<int64_t>& p0s, bool climb = false) {
  const int64_t W = R + rope, B = int64_t(p0s.size());
  const float scale = float(1.0 / std::sqrt(double(W)));
  Tensor q = random_rows(B * T * H, W, 11);
  if (climb) {
    EXPECT_GT(rope, 0) << "climb: the step column must lie outside R";
    for (int64_t i = 0; i < B * T * H; ++i) q.f32()[i * W + W - 1] = 1.0f;
  }
  std::vector<std::vector<float>> rows;  // per sequence, as the kernel reads them
  std::vector<device::Buffer> bufs;
  std::vector<const void*> ptrs;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = (p0s[size_t(b)] + T) * W;
    Tensor r = random_rows(p0s[size_t(b)] + T, W, 20 + uint64_t(b));
    if (climb)
      for (int64_t s = 0; s < p0s[size_t(b)] + T; ++s) r.f32()[s * W + W - 1] = 200.0f * float((s / 64) % 3);
    bufs.push_back(device::upload_values(r.f32(), n, st));
    rows.emplace_back(size_t(n));
    device::download_values(rows.back().data(), bufs.back(), n, st);
    ptrs.push_back(bufs.back().get());
    longest = std::max(longest, p0s[size_t(b)] + T);
  }
  device::Buffer d_q = device::upload_values(q.f32(), q.numel(), device::Storage::F32);
  device::Buffer d_ptrs = device::upload_new(ptrs.data(), ptrs.size() * sizeof(void*));
  device::Buffer d_p0 = device::upload_new(p0s.data(), p0s.size() * 8);
  device::Buffer d_ob(size_t(B * T * H * R) * 4);
  cuda::latent_attention(d_q.as<float>(), d_ptrs.as<const void*>(), st, d_p0.as<int64_t>(), longest, d_ob.as<float>(),
                         B, T, H, W, R, scale);
  std::vector<float> ob(size_t(B * T * H * R));
  device::download_values(ob.data(), d_ob, int64_t(ob.size()), device::Storage::F32);
  double num = 0, den = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = q.f32() + ((b * T + t) * H + h) * W;
        const std::vector<float>& lat = rows[size_t(b)];
        const int64_t n = p0s[size_t(b)] + t + 1;
        std::vector<double> p(static_cast<size_t>(n));
        double mx = -INFINITY, z = 0;
        for (int64_t s = 0; s < n; ++s) {
          double d = 0;
          for (int64_t k = 0; k < W; ++k) d += double(qh[k]) * lat[size_t(s * W + k)];
          p[size_t(s)] = d * scale;
          mx = std::max(mx, p[size_t(s)]);
        }
        for (double& x : p) z += x = std::exp(x - mx);
        for (int64_t r = 0; r < R; ++r) {
          double o = 0;
          for (int64_t s = 0; s < n; ++s) o += p[size_t(s)] * lat[size_t(s * W + r)];
          o /= z;
          num += std::pow(o - ob[size_t(((b * T + t) * H + h) * R + r)], 2);
          den += o * o;
        }
      }
  return std::sqrt(num / den);
}

struct LatentCase {
  int64_t R, rope, H;
};
std::string describe(device::Storage st, const LatentCase& c) {
  return std::string(st == device::Storage::BF16 ? "bf16 " : "fp32 ") + std::to_string(c.R) + " + " +
         std::to_string(c.rope) + ", " + std::to_string(c.H) + " heads";
}

// Three sequences of 7 to 702 rows, two new tokens each, at widths taken by every kernel (16-byte,
// bulk and scalar copies; head groups of 4, 6, 12 and 20 heads; bf16 512 + 64 is the warpgroup
// kernel's). q and p enter the bf16 products as bf16 pairs (hi + lo), so both storages
// stay within 1e-5 of the reference over their own rows.
TEST(MlaCudaKernels, LatentAttentionMatchesADoubleReference) {
  for (const device::Storage st : {device::Storage::F32, device::Storage::BF16})
    for (const LatentCase& c : {LatentCase{512, 64, 20}, LatentCase{96, 32, 6}, LatentCase{45, 6, 4},
                                LatentCase{101, 6, 20}, LatentCase{48, 8, 12}, LatentCase{36, 4, 4}}) {
      SCOPED_TRACE(describe(st, c));
      EXPECT_LT(latent_attention_error(st, c.R, c.rope, c.H, 2, {700, 90, 5}), 1e-5);
    }
}

// 64 sequences' cached rows, 8,000 to 8,819.
std::vector<int64_t> long_sequences() {
  std::vector<int64_t> p0s;
  for (int64_t b = 0; b < 64; ++b) p0s.push_back(8000 + 13 * b);
  return p0s;
}

// 64 sequences of 8,000 to 8,820 rows: chunks of many tiles and slabs, so a chunk's last, partial
// tile or slab lands on a ring stage already filled (its rows past the end hold earlier rows,
// which must score −∞), in the wide and the narrow kernels of both storages (bf16 512 + 64: the
// warpgroup kernel). Then 16 sequences of 512 + 64 with 16 heads in bf16: the warpgroup kernel's
// chunks of several 64-row tiles, both stages taken more than once.
TEST(MlaCudaKernels, PartialTilesOnReusedStagesMatchADoubleReference) {
  std::vector<int64_t> p0s = long_sequences();
  for (const device::Storage st : {device::Storage::F32, device::Storage::BF16})
    for (const LatentCase& c : {LatentCase{512, 64, 2}, LatentCase{96, 32, 6}}) {
      SCOPED_TRACE(describe(st, c));
      EXPECT_LT(latent_attention_error(st, c.R, c.rope, c.H, 1, p0s), 1e-5);
    }
  p0s.resize(16);
  SCOPED_TRACE("bf16 512 + 64, 16 heads, 16 sequences");
  EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 16, 1, p0s), 1e-5);
}

// bf16 512 + 64 goes to the warpgroup kernel; the mma.sync kernel, which takes every other wide
// bf16 latent, can take it too (cuda::set_latent_kernel). Runs f with each kernel chosen (then
// back to Auto), given long_sequences().
template <class F>
void on_both_kernels(F&& f) {
  struct Scope {  // the process-wide choice, restored however f ends
    explicit Scope(cuda::LatentKernel k) { cuda::set_latent_kernel(k); }
    ~Scope() { cuda::set_latent_kernel(cuda::LatentKernel::Auto); }
  };
  const std::vector<int64_t> p0s = long_sequences();
  for (const cuda::LatentKernel kernel : {cuda::LatentKernel::MmaSync, cuda::LatentKernel::Warpgroup}) {
    SCOPED_TRACE(kernel == cuda::LatentKernel::MmaSync ? "mma.sync kernel" : "warpgroup kernel");
    const Scope scope(kernel);
    f(p0s);
  }
}

TEST(MlaCudaKernels, BothKernelsOfDeepSeekLatentsMatchADoubleReference) {
  on_both_kernels([](const std::vector<int64_t>& p0s) {
    EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 20, 2, {700, 90, 5}), 1e-5);
    EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 2, 1, p0s), 1e-5);
  });
}

// Scores that climb by more than the slack every third tile (latent_attention_error's `climb`):
// the warpgroup kernel's maxima move mid-chunk and its sums are rescaled (the random scores
// above move them by 1–2 units at most after a chunk's first tile), and so are the mma.sync
// kernel's. 64 and 16 sequences of 8,000+ rows: the warpgroup kernel's chunks are 35 and 17 tiles
// long on 132 SMs.
TEST(MlaCudaKernels, MaximaThatMoveMidChunkRescaleWhatWasSummed) {
  on_both_kernels([](const std::vector<int64_t>& p0s) {
    EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 2, 1, p0s, true), 1e-5);
    EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 16, 1, {p0s.begin(), p0s.begin() + 16}, true),
              1e-5);
  });
}

// Two blocks per SM's worth of (token, head group) rows of 901 to 1,090 latent rows (at most 18
// tiles): the warpgroup kernel takes each in one chunk (two waves of 18 tiles beat four of 9)
// and writes ob = acc / l itself, without partial results or the combine step. Then as many
// sequences with two tokens each and 20 heads (a group of 16 and one of 4): four waves of one
// chunk beat eight of two.
TEST(MlaCudaKernels, OneChunkPerRowWritesTheOutputItself) {
  std::vector<int64_t> p0s;
  for (int64_t b = 0; b < 2 * device::sm_count(); ++b) p0s.push_back(900 + (7 * b) % 190);
  EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 16, 1, p0s), 1e-5);
  p0s.resize(size_t(device::sm_count()));
  SCOPED_TRACE("two tokens per sequence, 20 heads");
  EXPECT_LT(latent_attention_error(device::Storage::BF16, 512, 64, 20, 2, p0s), 1e-5);
}

}  // namespace
}  // namespace k3
