// The differentiable ops' CUDA forms (ag_cuda.h) against their CPU forms on random inputs: the
// same call on host Vars and on device Vars, forward and backward from the same cotangent, fp32,
// within 1e-5 relative L2 for the output and every input's gradient (the CPU forms are tested
// against fixtures and finite differences elsewhere). Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "core/random.h"
#include "ops/ag.h"
#include "ops/ag_conv.h"
#include "ops/ag_cuda.h"
#include "ops/ag_cuda_testing.h"
#include "ops/ag_heads.h"
#include "ops/ag_moe.h"
#include "ops/ag_norms.h"
#include "ops/situ.h"

namespace k3 {
namespace {

using testing::rand_var;
Var to_cuda(const Var& v) { return v ? constant(v->value.to_device(Device::CUDA)) : nullptr; }

// Output and gradients of f on the host and on the device; the largest relative difference.
double compare(const std::vector<Var>& inputs, const std::function<Var(const std::vector<Var>&)>& f) {
  std::string what;
  const double d = testing::compare_with_grads(inputs, f, &what);
  EXPECT_LT(d, 1e-5) << "worst: " << what;
  return d;
}

constexpr double kTol = 1e-5;

TEST(AgCuda, LinearBothLayoutsWithAndWithoutBias) {
  Rng rng(1);
  Var x = rand_var(rng, {2, 7, 48}), w_oi = rand_var(rng, {40, 48}), w_io = rand_var(rng, {48, 40}), b = rand_var(rng, {40});
  EXPECT_LT(compare({x, w_oi, b}, [](auto& v) { return ag::linear(v[0], v[1], v[2], WeightLayout::OutIn); }), kTol);
  EXPECT_LT(compare({x, w_io}, [](auto& v) { return ag::linear(v[0], v[1], nullptr, WeightLayout::InOut); }), kTol);
}

TEST(AgCuda, Elementwise) {
  Rng rng(2);
  Var a = rand_var(rng, {33, 65}, 3.0f), b = rand_var(rng, {33, 65});
  EXPECT_LT(compare({a, b}, [](auto& v) { return ag::add(v[0], v[1]); }), kTol);
  EXPECT_LT(compare({a, b}, [](auto& v) { return ag::sub(v[0], v[1]); }), kTol);
  EXPECT_LT(compare({a, b}, [](auto& v) { return ag::mul(v[0], v[1]); }), kTol);
  EXPECT_LT(compare({a}, [](auto& v) { return ag::scale(v[0], -0.37f); }), kTol);
  EXPECT_LT(compare({a}, [](auto& v) { return ag::sigmoid(v[0]); }), kTol);
  EXPECT_LT(compare({a}, [](auto& v) { return ag::silu(v[0]); }), kTol);
  EXPECT_LT(compare({a}, [](auto& v) { return ag::gelu_tanh(v[0]); }), kTol);
  EXPECT_LT(compare({a, b}, [](auto& v) { return ag::situ_glu(v[0], v[1], SituOptions{}); }), kTol);
  EXPECT_LT(compare({a, b}, [](auto& v) { return ag::silu_glu(v[0], v[1]); }), kTol);
}

TEST(AgCuda, Norms) {
  Rng rng(3);
  Var x = rand_var(rng, {19, 96}, 2.0f), w = rand_var(rng, {96}), b = rand_var(rng, {96}), g = rand_var(rng, {19, 96});
  Var wh = rand_var(rng, {32});
  EXPECT_LT(compare({x, w, b}, [](auto& v) { return ag::layernorm(v[0], v[1], v[2], 1e-5f); }), kTol);
  EXPECT_LT(compare({x, w}, [](auto& v) { return ag::rmsnorm(v[0], v[1], 1e-6f); }), kTol);
  EXPECT_LT(compare({x}, [](auto& v) { return ag::rmsnorm(v[0], nullptr, 1e-6f); }), kTol);
  EXPECT_LT(compare({x}, [](auto& v) { return ag::l2norm(v[0], 32, 1e-6f); }), kTol);
  for (auto act : {ag::NormGate::Sigmoid, ag::NormGate::Swish})
    EXPECT_LT(compare({x, g, wh}, [act](auto& v) { return ag::gated_rmsnorm(v[0], v[1], v[2], 32, 1e-5f, act); }), kTol);
  EXPECT_LT(compare({x, wh}, [](auto& v) { return ag::gated_rmsnorm(v[0], nullptr, v[1], 32, 1e-5f, ag::NormGate::None); }),
            kTol);
}

TEST(AgCuda, EmbeddingAndLayouts) {
  Rng rng(4);
  Var table = rand_var(rng, {50, 24}), x = rand_var(rng, {6, 4 * 12}), y = rand_var(rng, {6, 4 * 5}), r = rand_var(rng, {6, 5});
  const std::vector<int64_t> ids = {3, 49, 0, 3, 17};
  EXPECT_LT(compare({table}, [&](auto& v) { return ag::embedding(v[0], ids); }), kTol);
  // A padding id gets no gradient (row 3 appears twice; the CPU form is the reference).
  EXPECT_LT(compare({table}, [&](auto& v) { return ag::embedding(v[0], ids, 3); }), kTol);
  EXPECT_LT(compare({x}, [](auto& v) { return ag::slice_last(v[0], 7, 30); }), kTol);
  EXPECT_LT(compare({x, y}, [](auto& v) { return ag::concat_last({v[0], v[1], v[0]}); }), kTol);
  EXPECT_LT(compare({x}, [](auto& v) { return ag::head_slice(v[0], 4, 3, 10); }), kTol);
  EXPECT_LT(compare({x, y}, [](auto& v) { return ag::head_concat({v[0], v[1]}, 4); }), kTol);
  EXPECT_LT(compare({r}, [](auto& v) { return ag::broadcast_heads(v[0], 3); }), kTol);
  const RopeTable rope = make_rope(8, 10000.0);
  const std::vector<int64_t> pos = {0, 1, 2, 7, 100, 5};
  EXPECT_LT(compare({x}, [&](auto& v) { return ag::rope(v[0], pos, 4, 4, rope); }), kTol);
}

TEST(AgCuda, CausalAttentionWithDifferentValueWidth) {
  Rng rng(5);
  const int64_t B = 2, T = 37, H = 3;
  Var q = rand_var(rng, {B * T, H * 24}), k = rand_var(rng, {B * T, H * 24}), v = rand_var(rng, {B * T, H * 16});
  EXPECT_LT(compare({q, k, v}, [](auto& a) { return ag::causal_attention(a[0], a[1], a[2], 2, 37, 3, 0.2f); }), kTol);
}

TEST(AgCuda, ShortConvolution) {
  Rng rng(6);
  Var x = rand_var(rng, {3 * 11, 20}), w = rand_var(rng, {20, 1, 4});
  EXPECT_LT(compare({x, w}, [](auto& v) { return ag::short_conv(v[0], v[1], 3, 11); }), kTol);
}

TEST(AgCuda, MixtureOfExpertsRouting) {
  Rng rng(7);
  const int64_t M = 9, E = 6, K = 2, N = 10;
  Var logits = rand_var(rng, {M, E}), offset = rand_var(rng, {E});
  EXPECT_LT(compare({logits}, [](auto& v) { return ag::softmax_last(v[0]); }), kTol);
  std::vector<int64_t> idx;
  for (int64_t m = 0; m < M; ++m) idx.insert(idx.end(), {m % E, (m * 5 + 1) % E == m % E ? (m + 1) % E : (m * 5 + 1) % E});
  EXPECT_LT(compare({logits, offset}, [&](auto& v) { return ag::gather_cols(v[0], idx, K, v[1]->value); }), kTol);
  // The sequence-level balance loss (3 sequences of 3 tokens): a host scalar from device scores.
  EXPECT_LT(compare({logits}, [&](auto& v) { return ag::seq_balance_loss(ag::softmax_last(v[0]), idx, K, 3, 0.1f); }),
            kTol);
  Var w = constant(Tensor::full({M, K}, 0.5f));
  for (int64_t i = 0; i < M * K; ++i) w->value.f32()[i] = 0.1f + float(i % 7);
  EXPECT_LT(compare({w}, [](auto& v) { return ag::normalize_sum_last(v[0], 1e-20f); }), kTol);
  const std::vector<int64_t> rows = {8, 0, 3, 3, 5};
  Var x = rand_var(rng, {M, N});
  EXPECT_LT(compare({x}, [&](auto& v) { return ag::gather_rows(v[0], rows); }), kTol);
  const ag::Dispatch d = ag::make_dispatch(idx, M, K, E);
  std::vector<Var> ys;
  for (int64_t j = 0; j < d.active(); ++j) ys.push_back(rand_var(rng, {d.offsets[size_t(j) + 1] - d.offsets[size_t(j)], N}));
  std::vector<Var> all = ys;
  all.push_back(w);
  EXPECT_LT(compare(all, [&](auto& v) {
              return ag::weighted_combine(std::vector<Var>(v.begin(), v.end() - 1), d, v.back(), M);
            }),
            kTol);
}

// The mean cross-entropy of the head's logits, with and without the z-loss, some targets ignored;
// its gradients with respect to the hidden states and the head.
TEST(AgCuda, CrossEntropyHeadWithZLoss) {
  Rng rng(9);
  Var h = rand_var(rng, {37, 24}), w = rand_var(rng, {301, 24}, 0.5f);
  std::vector<int64_t> targets(37);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 5 == 3 ? -1 : int64_t((i * 97) % 301);
  for (float z : {0.0f, 1e-2f, 0.3f})  // the loss is a host scalar on both devices
    EXPECT_LT(compare({h, w}, [&](auto& v) { return ag::cross_entropy_head(v[0], v[1], targets, 64, z); }), kTol)
        << "z_loss " << z;
}

// Mixed precision: under Bf16Gemms the GEMM operands of linear, the head and attention are rounded
// to bf16 (fp32 accumulation): the output and every gradient stay within the bf16 tolerance (5e-3
// relative) of the fp32 CPU, and differ from it by more than fp32 noise (the path is taken).
TEST(AgCuda, Bf16GemmsStayWithinTheBf16Tolerance) {
  Rng rng(12);
  Var x = rand_var(rng, {2, 29, 96}), w_oi = rand_var(rng, {80, 96}), w_io = rand_var(rng, {96, 80}), b = rand_var(rng, {80});
  Var h = rand_var(rng, {37, 64}), head = rand_var(rng, {301, 64}, 0.5f);
  // Attention at head dims 64 and 128 (the tensor-core kernels), 100 and 70 tokens.
  Var q64 = rand_var(rng, {2 * 100, 4 * 64}), k64 = rand_var(rng, {2 * 100, 4 * 64}), v64 = rand_var(rng, {2 * 100, 4 * 64});
  Var q128 = rand_var(rng, {70, 2 * 128}), k128 = rand_var(rng, {70, 2 * 128}), v128 = rand_var(rng, {70, 2 * 128});
  std::vector<int64_t> targets(37);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 5 == 3 ? -1 : int64_t((i * 97) % 301);
  ag::gpu::Bf16Gemms bf16;
  for (const auto& [name, d] :
       {std::pair{"linear out-in", testing::compare_with_grads({x, w_oi, b}, [](auto& v) {
          return ag::linear(v[0], v[1], v[2], WeightLayout::OutIn);
        })},
        std::pair{"linear in-out", testing::compare_with_grads({x, w_io}, [](auto& v) {
          return ag::linear(v[0], v[1], nullptr, WeightLayout::InOut);
        })},
        std::pair{"head", testing::compare_with_grads({h, head}, [&](auto& v) {
          return ag::cross_entropy_head(v[0], v[1], targets, 64, 0.0f);
        })},
        std::pair{"attention hd 64", testing::compare_with_grads({q64, k64, v64}, [](auto& v) {
          return ag::causal_attention(v[0], v[1], v[2], 2, 100, 4, 0.125f);
        })},
        std::pair{"attention hd 128", testing::compare_with_grads({q128, k128, v128}, [](auto& v) {
          return ag::causal_attention(v[0], v[1], v[2], 1, 70, 2, 0.0884f);
        })}}) {
    EXPECT_LT(d, 5e-3) << name;
    EXPECT_GT(d, 1e-4) << name << ": no bf16 rounding seen";
  }
}

// Gradients flow through a chain of ops into the same leaf twice (accumulation on the device).
TEST(AgCuda, GradientsAccumulateAcrossUses) {
  Rng rng(10);
  Var x = rand_var(rng, {5, 16}), w = rand_var(rng, {16, 16});
  EXPECT_LT(compare({x, w}, [](auto& v) {
              Var h = ag::silu(ag::linear(v[0], v[1], nullptr, WeightLayout::OutIn));
              return ag::mul(ag::add(h, v[0]), ag::linear(h, v[1], nullptr, WeightLayout::InOut));
            }),
            kTol);
}

TEST(AgCuda, TrainingThroughBf16WeightsIsRefusedClearly) {
  Rng rng(8);
  Var x = to_cuda(rand_var(rng, {4, 8}));
  x->requires_grad = true;
  Var w = constant(rand_var(rng, {8, 8})->value.to(DType::BF16).to_device(Device::CUDA));
  Var y;
  {
    Recording rec;
    y = ag::linear(x, w, nullptr, WeightLayout::OutIn);
  }
  try {
    backward(y, Tensor::full({4, 8}, 1.0f));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
}

TEST(AgCuda, MixedDevicesAreAClearError) {
  Rng rng(9);
  Var a = to_cuda(rand_var(rng, {4, 8})), b = rand_var(rng, {4, 8});
  try {
    ag::add(a, b);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("on the host"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3
