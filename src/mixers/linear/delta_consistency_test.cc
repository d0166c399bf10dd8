// Chunked == recurrent == token-by-token decode on random shapes that break kernels (T = 1, 63,
// 64, 65, 200; K ≠ V; HV = 2H; gates down to −5 per token), and packed varlen == separate
// sequences.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_test_util.h"

namespace k3::linear {
namespace {

using testing::kVariants;
using testing::options;
using testing::random_cotangents;
using testing::random_inputs;
using testing::randn;
using testing::uniform;
using testing::rel_l2;
using testing::Variant;

constexpr double kTol = 1e-4;

void expect_close(const Tensor& a, const Tensor& b, const std::string& what) {
  if (!b.defined()) return;
  ASSERT_TRUE(a.defined()) << what;
  EXPECT_LE(rel_l2(a, b), kTol) << what;
}

void expect_grads_close(const DeltaGrads& a, const DeltaGrads& b, const std::string& label) {
  expect_close(a.dq, b.dq, label + " dq");
  expect_close(a.dk, b.dk, label + " dk");
  expect_close(a.dv, b.dv, label + " dv");
  expect_close(a.dbeta, b.dbeta, label + " dbeta");
  expect_close(a.dg, b.dg, label + " dg");
  expect_close(a.dh0, b.dh0, label + " dh0");
  expect_close(a.dz0, b.dz0, label + " dz0");
}

class DeltaConsistency : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(DeltaConsistency, ChunkedRecurrentAndDecodeAgree) {
  const Variant& var = kVariants[std::get<0>(GetParam())];
  const int64_t T = std::get<1>(GetParam());
  const int64_t B = 2, H = 2, HV = 4, K = 16, V = 24;
  const DeltaInputs in = random_inputs(var, B, T, H, HV, K, V, B, 1000 + T);
  const DeltaCotangents cot = random_cotangents(var, B, T, HV, K, V, B, 2000 + T);
  DeltaOptions opts = options(var);
  const std::string label = std::string(var.name) + " T=" + std::to_string(T);

  const DeltaOutputs ref = delta_forward(in, opts, Impl::Recurrent);
  const DeltaGrads gref = delta_backward(in, cot, opts, Impl::Recurrent);
  for (int chunk : {16, 64}) {
    opts.chunk = chunk;
    const DeltaOutputs out = delta_forward(in, opts, Impl::Chunked);
    const std::string l = label + " chunk=" + std::to_string(chunk);
    expect_close(out.o, ref.o, l + " o");
    expect_close(out.ht, ref.ht, l + " ht");
    expect_close(out.zt, ref.zt, l + " zt");
    expect_grads_close(delta_backward(in, cot, opts, Impl::Chunked), gref, l);
  }

  // Token-by-token decode from h0 reproduces the outputs and the final state.
  DeltaState st;
  st.S = in.h0.clone();
  if (in.z0.defined()) st.z = in.z0.clone();
  Tensor o = Tensor::empty({B, T, HV, V});  // [B, T, HV, V]
  for (int64_t t = 0; t < T; ++t) {
    DeltaInputs one;
    one.q = in.q.slice(1, t, t + 1).clone();  // [B, 1, H, K]
    one.k = in.k.slice(1, t, t + 1).clone();
    one.v = in.v.slice(1, t, t + 1).clone();  // [B, 1, HV, V]
    if (in.beta.defined()) one.beta = in.beta.slice(1, t, t + 1).clone();
    if (in.g.defined()) one.g = in.g.slice(1, t, t + 1).clone();
    Tensor ot = delta_step(one, st, opts);  // [B, 1, HV, V]
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < HV * V; ++i) o.f32()[(b * T + t) * HV * V + i] = ot.f32()[b * HV * V + i];
  }
  expect_close(o, ref.o, label + " decode o");
  expect_close(st.S, ref.ht, label + " decode state");
  expect_close(st.z, ref.zt, label + " decode z");

  // The same decode with each sequence's state in its own allocation (a decode batch's memories),
  // updated in place through per-sequence pointers.
  const bool norm = in.z0.defined();
  std::vector<Tensor> Sb, zb;
  DeltaState ps;
  for (int64_t b = 0; b < B; ++b) {
    Sb.push_back(in.h0.slice(0, b, b + 1).clone());  // [1, HV, K, V]
    ps.S_seq.push_back(Sb.back().f32());
    if (norm) {
      zb.push_back(in.z0.slice(0, b, b + 1).clone());  // [1, HV, K]
      ps.z_seq.push_back(zb.back().f32());
    }
  }
  Tensor o2 = Tensor::empty({B, T, HV, V});  // [B, T, HV, V]
  for (int64_t t = 0; t < T; ++t) {
    DeltaInputs one;
    one.q = in.q.slice(1, t, t + 1).clone();
    one.k = in.k.slice(1, t, t + 1).clone();
    one.v = in.v.slice(1, t, t + 1).clone();
    if (in.beta.defined()) one.beta = in.beta.slice(1, t, t + 1).clone();
    if (in.g.defined()) one.g = in.g.slice(1, t, t + 1).clone();
    Tensor ot = delta_step(one, ps, opts);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < HV * V; ++i) o2.f32()[(b * T + t) * HV * V + i] = ot.f32()[b * HV * V + i];
  }
  expect_close(o2, ref.o, label + " per-sequence decode o");
  for (int64_t b = 0; b < B; ++b) {
    expect_close(Sb[size_t(b)], ref.ht.slice(0, b, b + 1).clone(), label + " per-sequence decode state");
    if (norm) expect_close(zb[size_t(b)], ref.zt.slice(0, b, b + 1).clone(), label + " per-sequence decode z");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeltaConsistency,
                         ::testing::Combine(::testing::Range(0, 5), ::testing::Values<int64_t>(1, 63, 64, 65, 200)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int64_t>>& param_info) {
                           return std::string(kVariants[std::get<0>(param_info.param)].name) + "_T" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// Packed sequences (cu_seqlens, B = 1) equal the same sequences run one by one.
class DeltaVarlen : public ::testing::TestWithParam<int> {};

TEST_P(DeltaVarlen, PackedEqualsSeparate) {
  const Variant& var = kVariants[GetParam()];
  const std::vector<int64_t> lens = {5, 64, 0, 71, 1};
  std::vector<int64_t> cu = {0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), N = int64_t(lens.size()), H = 1, HV = 2, K = 8, V = 12;
  DeltaInputs packed = random_inputs(var, 1, T, H, HV, K, V, N, 77);
  packed.cu_seqlens = cu;
  const DeltaCotangents cot = random_cotangents(var, 1, T, HV, K, V, N, 78);
  DeltaOptions opts = options(var);
  opts.chunk = 16;
  for (Impl impl : {Impl::Recurrent, Impl::Chunked}) {
    const std::string label = std::string(var.name) + (impl == Impl::Chunked ? " chunked" : " recurrent");
    const DeltaOutputs out = delta_forward(packed, opts, impl);
    const DeltaGrads gp = delta_backward(packed, cot, opts, impl);
    for (int64_t n = 0; n < N; ++n) {
      if (lens[n] == 0) {  // an empty sequence passes its state through
        expect_close(out.ht.select(0, n).clone(), packed.h0.select(0, n).clone(), label + " empty ht");
        continue;
      }
      auto rows = [&](const Tensor& t) { return t.slice(1, cu[n], cu[n + 1]).clone(); };
      auto seq = [&](const Tensor& t) { return t.slice(0, n, n + 1).clone(); };
      DeltaInputs one;
      one.q = rows(packed.q);
      one.k = rows(packed.k);
      one.v = rows(packed.v);
      if (packed.beta.defined()) one.beta = rows(packed.beta);
      if (packed.g.defined()) one.g = rows(packed.g);
      one.h0 = seq(packed.h0);
      if (packed.z0.defined()) one.z0 = seq(packed.z0);
      DeltaCotangents c1{rows(cot.d_o), seq(cot.dht), cot.dzt.defined() ? seq(cot.dzt) : Tensor()};
      const DeltaOutputs o1 = delta_forward(one, opts, impl);
      const std::string l = label + " seq " + std::to_string(n);
      expect_close(rows(out.o), o1.o, l + " o");
      expect_close(seq(out.ht), o1.ht, l + " ht");
      const DeltaGrads g1 = delta_backward(one, c1, opts, impl);
      expect_close(rows(gp.dq), g1.dq, l + " dq");
      expect_close(rows(gp.dk), g1.dk, l + " dk");
      expect_close(rows(gp.dv), g1.dv, l + " dv");
      if (g1.dbeta.defined()) expect_close(rows(gp.dbeta), g1.dbeta, l + " dbeta");
      if (g1.dg.defined()) expect_close(rows(gp.dg), g1.dg, l + " dg");
      expect_close(seq(gp.dh0), g1.dh0, l + " dh0");
      if (g1.dz0.defined()) expect_close(seq(gp.dz0), g1.dz0, l + " dz0");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, DeltaVarlen, ::testing::Range(0, 5),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return std::string(kVariants[param_info.param].name);
                         });

TEST(DeltaErrors, BadInputsRaiseK3Error) {
  Rng rng(1);
  DeltaInputs in;
  in.q = randn(rng, {1, 4, 2, 8});
  in.k = randn(rng, {1, 4, 2, 8});
  in.v = randn(rng, {1, 4, 3, 8});  // HV = 3 is not a multiple of H = 2
  DeltaOptions opts;
  opts.write = Write::Additive;
  EXPECT_THROW(delta_forward(in, opts, Impl::Chunked), Error);
  in.v = randn(rng, {1, 4, 2, 8});
  opts.write = Write::Delta;  // no beta
  EXPECT_THROW(delta_forward(in, opts, Impl::Chunked), Error);
  in.beta = uniform(rng, {1, 4, 2}, 0.0f, 1.0f);
  opts.decay = Decay::PerChannel;
  in.g = uniform(rng, {1, 4, 2}, -1.0f, 0.0f);  // scalar-shaped gate for a per-channel rule
  EXPECT_THROW(delta_forward(in, opts, Impl::Chunked), Error);
  opts.decay = Decay::None;
  in.cu_seqlens = {0, 3};  // does not end at T
  EXPECT_THROW(delta_forward(in, opts, Impl::Chunked), Error);
}

}  // namespace
}  // namespace k3::linear
