// The delta-rule family on CUDA (delta_cuda.cu) against flash-linear-attention's naive references
// (fixtures/ops) and against the CPU recurrent reference on random shapes that break kernels
// (T = 1, 63, 64, 65, 200; K ≠ V; HV = 2H; K = V = 128; packed sequences). fp32 storage within
// 1e-4 relative L2, bf16 storage within 5e-3 (fixtures/README.md, "Tolerances"), or within 1.25x
// of what bf16-rounded inputs cost in exact arithmetic where that alone exceeds 5e-3 (the
// Katharopoulos normaliser divides by s·q·z, which amplifies the rounding of q and k).
// Needs a GPU: label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "core/device.h"
#include "io/safetensors.h"
#include "mixers/linear/ag_delta.h"
#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/linear/delta_test_util.h"
#include "ops/ag.h"
#include "ops/ag_cuda_testing.h"
#include "ops/ag_norms.h"
#include "ops/gates.h"

namespace k3::linear {
namespace {

using testing::kVariants;
using testing::random_cotangents;
using testing::random_inputs;
using testing::rel_l2;
using testing::Variant;

double tolerance(DType io) { return io == DType::BF16 ? 5e-3 : 1e-4; }

Tensor round_bf16(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor r = t.clone();
  for (int64_t i = 0; i < r.numel(); ++i) r.f32()[i] = round_to_bf16(r.f32()[i]);
  return r;
}

void expect_close(const Tensor& a, const Tensor& ref, double tol, const std::string& what) {
  if (!ref.defined()) return;
  ASSERT_TRUE(a.defined()) << what << " not produced";
  const double e = rel_l2(a, ref);
  EXPECT_LE(e, tol) << what;
  if (std::getenv("K3_VERBOSE")) std::printf("%-60s %.2e\n", what.c_str(), e);
}

class DeltaCudaFixture : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(DeltaCudaFixture, MatchesReference) {
  const auto& [file, io] = GetParam();
  SafeTensors st = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/ops/" + file);
  DeltaOptions opts = testing::fixture_options(nlohmann::json::parse(st.metadata().at("fixture")));
  opts.device = Device::CUDA;
  opts.io_dtype = io;
  DeltaInputs in;
  in.q = st.get_f32("q");
  in.k = st.get_f32("k");
  in.v = st.get_f32("v");
  if (st.has("beta")) in.beta = st.get_f32("beta");
  if (st.has("g")) in.g = st.get_f32("g");
  if (st.has("h0")) in.h0 = st.get_f32("h0");
  DeltaCotangents cot;
  cot.d_o = st.get_f32("do");
  if (st.has("dht")) cot.dht = st.get_f32("dht");
  const std::string label = file + (io == DType::BF16 ? " bf16" : " f32");
  const DeltaOutputs out = delta_forward(in, opts, Impl::Recurrent);
  const DeltaOutputs chunked = delta_forward(in, opts, Impl::Chunked);
  const DeltaGrads g = delta_backward(in, cot, opts, Impl::Recurrent);
  const DeltaGrads gc = delta_backward(in, cot, opts, Impl::Chunked);
  std::map<std::string, Tensor> got = {
      {"o", out.o},         {"ht", out.ht},        {"o chunked", chunked.o},          {"ht chunked", chunked.ht},
      {"grad_q", g.dq},     {"grad_k", g.dk},      {"grad_v", g.dv},                  {"grad_beta", g.dbeta},
      {"grad_g", g.dg},     {"grad_h0", g.dh0},    {"grad_q chunked", gc.dq},         {"grad_k chunked", gc.dk},
      {"grad_v chunked", gc.dv}, {"grad_beta chunked", gc.dbeta}, {"grad_g chunked", gc.dg},
      {"grad_h0 chunked", gc.dh0}};
  // bf16 control: exact (CPU, double) arithmetic on the same bf16-rounded q/k/v/do. Rounding the
  // inputs alone costs that much; the kernel may not add more than a quarter on top, and must be
  // within the fixtures' 5e-3 wherever the control is.
  std::map<std::string, Tensor> control;
  if (io == DType::BF16) {
    DeltaInputs rin = in;
    rin.q = round_bf16(in.q), rin.k = round_bf16(in.k), rin.v = round_bf16(in.v);
    DeltaCotangents rcot = cot;
    rcot.d_o = round_bf16(cot.d_o);
    DeltaOptions cpu = opts;
    cpu.device = Device::CPU;
    const DeltaOutputs co = delta_forward(rin, cpu, Impl::Recurrent);
    const DeltaGrads cg = delta_backward(rin, rcot, cpu, Impl::Recurrent);
    control = {{"o", co.o},      {"ht", co.ht},   {"grad_q", cg.dq},       {"grad_k", cg.dk},
               {"grad_v", cg.dv}, {"grad_g", cg.dg}, {"grad_beta", cg.dbeta}, {"grad_h0", cg.dh0}};
  }
  for (const auto& [name, t] : got) {
    const std::string ref_name = name.substr(0, name.find(' '));  // "o chunked" is checked against "o"
    if (!st.has(ref_name)) continue;
    const Tensor ref = st.get_f32(ref_name);
    double tol = tolerance(io);
    if (io == DType::BF16) {
      const double floor = rel_l2(control.at(ref_name), ref);
      tol = std::max(tol, 1.25 * floor);
      if (std::getenv("K3_VERBOSE")) std::printf("%-60s control %.2e\n", (label + " " + name).c_str(), floor);
    }
    expect_close(t, ref, tol, label + " " + name);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, DeltaCudaFixture,
    ::testing::Combine(::testing::Values("linear_attn.safetensors", "linear_attn_normalized.safetensors",
                                         "delta_rule.safetensors", "gated_delta_rule.safetensors",
                                         "gated_delta_rule_extreme_decay.safetensors", "kda_logsigmoid.safetensors",
                                         "kda_lowerbound.safetensors", "kda_extreme_decay.safetensors"),
                       ::testing::Values(DType::F32, DType::BF16)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, DType>>& p) {
      const std::string& f = std::get<0>(p.param);
      return f.substr(0, f.find('.')) + (std::get<1>(p.param) == DType::BF16 ? "_bf16" : "_f32");
    });

// CUDA against the CPU recurrent reference on the same inputs: outputs, states, every gradient.
void expect_gpu_matches_cpu(const DeltaInputs& in, const DeltaCotangents& cot, const Variant& var,
                            const std::string& label) {
  DeltaOptions cpu = testing::options(var), gpu = cpu;
  gpu.device = Device::CUDA;
  const DeltaOutputs ref = delta_forward(in, cpu, Impl::Recurrent);
  const DeltaGrads gr = delta_backward(in, cot, cpu, Impl::Recurrent);
  for (const Impl impl : {Impl::Recurrent, Impl::Chunked}) {
    const std::string l = label + (impl == Impl::Chunked ? " chunked " : " ");
    const DeltaOutputs out = delta_forward(in, gpu, impl);
    expect_close(out.o, ref.o, 1e-4, l + "o");
    expect_close(out.ht, ref.ht, 1e-4, l + "ht");
    expect_close(out.zt, ref.zt, 1e-4, l + "zt");
    const DeltaGrads gg = delta_backward(in, cot, gpu, impl);
    expect_close(gg.dq, gr.dq, 1e-4, l + "dq");
    expect_close(gg.dk, gr.dk, 1e-4, l + "dk");
    expect_close(gg.dv, gr.dv, 1e-4, l + "dv");
    expect_close(gg.dbeta, gr.dbeta, 1e-4, l + "dbeta");
    expect_close(gg.dg, gr.dg, 1e-4, l + "dg");
    expect_close(gg.dh0, gr.dh0, 1e-4, l + "dh0");
    expect_close(gg.dz0, gr.dz0, 1e-4, l + "dz0");
  }
}

// Random shapes against the CPU recurrent reference (fp32 storage).
struct Shape6 {
  int64_t B, T, H, HV, K, V;
};
class DeltaCudaShapes : public ::testing::TestWithParam<std::tuple<int, Shape6>> {};

TEST_P(DeltaCudaShapes, MatchesCpuReference) {
  const Variant& var = kVariants[std::get<0>(GetParam())];
  const Shape6 s = std::get<1>(GetParam());
  const DeltaInputs in = random_inputs(var, s.B, s.T, s.H, s.HV, s.K, s.V, s.B, 7 + s.T);
  const DeltaCotangents cot = random_cotangents(var, s.B, s.T, s.HV, s.K, s.V, s.B, 9 + s.T);
  expect_gpu_matches_cpu(in, cot, var,
                         std::string(var.name) + " T=" + std::to_string(s.T) + " K=" + std::to_string(s.K) +
                             " V=" + std::to_string(s.V));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeltaCudaShapes,
                         ::testing::Combine(::testing::Range(0, 5),
                                            ::testing::Values(Shape6{2, 1, 2, 4, 16, 24}, Shape6{2, 63, 2, 4, 16, 24},
                                                              Shape6{1, 64, 1, 2, 32, 48}, Shape6{2, 65, 2, 2, 24, 16},
                                                              Shape6{1, 200, 2, 4, 16, 24},
                                                              Shape6{1, 70, 1, 1, 128, 128}, Shape6{1, 40, 1, 1, 64, 200},
                                                              Shape6{3, 1, 2, 4, 128, 128}, Shape6{2, 1, 1, 2, 100, 37})),
                         [](const ::testing::TestParamInfo<std::tuple<int, Shape6>>& p) {
                           const Shape6 s = std::get<1>(p.param);
                           return std::string(kVariants[std::get<0>(p.param)].name) + "_T" + std::to_string(s.T) +
                                  "_K" + std::to_string(s.K) + "_V" + std::to_string(s.V);
                         });

// Packed sequences (cu_seqlens) on the GPU equal the CPU reference on the same packing.
TEST(DeltaCudaVarlen, PackedMatchesCpu) {
  for (const Variant& var : kVariants) {
    const int64_t T = 150, H = 2, HV = 4, K = 32, V = 40;
    DeltaInputs in = random_inputs(var, 1, T, H, HV, K, V, 3, 11);
    in.cu_seqlens = {0, 1, 67, 150};
    const DeltaCotangents cot = random_cotangents(var, 1, T, HV, K, V, 3, 12);
    expect_gpu_matches_cpu(in, cot, var, std::string(var.name) + " varlen");
  }
}

// More (sequence, value head) pairs than a grid's y dimension holds (65,535): 4,100 sequences of
// 65 tokens (two chunks each) at 16 heads, the batch a prefill of many short prompts makes.
TEST(DeltaCudaVarlen, ManySequences) {
  for (const Variant& var : kVariants) {
    if (var.decay != Decay::PerChannel && var.write != Write::Additive) continue;
    if (var.normalize == Normalize::On) continue;
    const int64_t N = 4100, L = 65, T = N * L, H = 16, K = 4, V = 4;
    DeltaInputs in = random_inputs(var, 1, T, H, H, K, V, N, 13);
    in.cu_seqlens.resize(size_t(N) + 1);
    for (int64_t i = 0; i <= N; ++i) in.cu_seqlens[size_t(i)] = i * L;
    const DeltaCotangents cot = random_cotangents(var, 1, T, H, K, V, N, 14);
    expect_gpu_matches_cpu(in, cot, var, std::string(var.name) + " 4100 sequences");
  }
}

// The chunked kernels through the device API: bf16 storage, a packed batch with an empty
// sequence, and the scratch in windows of one and of three chunks (the state passes between
// windows through ht, here aliasing h0 as in serving; the backward keeps each window's entering
// state and carries the adjoint back through them), and in one window with the forward's scratch
// kept for the backward (ForwardScratch: the backward must take it instead of recomputing; with
// three-chunk windows it is kept too but the backward's h0 differs, so it must recompute),
// against the CPU recurrent reference. Both
// kernel sets: SIMT (fp32 arithmetic: gradients within 1e-4 of the CPU's on the same bf16-rounded
// inputs) and the tensor cores' (TF32 products: within the bf16 tolerance, 5e-3), the latter also
// at K 128 with a value width that is not a multiple of 4 (one-float copies into shared memory),
// at K 32 with V 20 (G's shared area narrower than T's copy; V a multiple of 4 but not of 8), and
// at V 144, whose 16 (sequence, head) pairs × 9 column tiles outnumber an H200's 132 SMs (recur
// and reverse take 32-column tiles).
struct ChunkedCase {
  bool simt;
  int64_t K, V;
};
class DeltaCudaChunked : public ::testing::TestWithParam<ChunkedCase> {};

TEST_P(DeltaCudaChunked, WindowsAndDeviceApi) {
  const ChunkedCase c = GetParam();
  const double grad_tol = c.simt ? 1e-4 : 5e-3;
  for (const Variant& var : kVariants) {
    if (var.normalize == Normalize::On) continue;  // the normaliser is the host wrapper's extra column
    const int64_t T = 300, H = 2, HV = 4, K = c.K, V = c.V;
    DeltaInputs in = random_inputs(var, 1, T, H, HV, K, V, 4, 21);
    in.cu_seqlens = {0, 130, 130, 131, 300};
    DeltaOptions cpu = testing::options(var);
    const DeltaOutputs ref = delta_forward(in, cpu, Impl::Recurrent);
    for (const int64_t window : {1, 3, 0}) {  // 0: the budget's one window, the scratch kept
      auto put = [](const Tensor& t, bool bf16) {
        return t.defined() ? device::upload_values(t.f32(), t.numel(), bf16 ? device::Storage::BF16 : device::Storage::F32)
                           : device::Buffer();
      };
      device::Buffer q = put(in.q, true), k = put(in.k, true), v = put(in.v, true), beta = put(in.beta, false),
                     g = put(in.g, false), S = put(in.h0, false);
      const std::vector<int64_t> r0 = {0, 130, 130, 131}, ln = {130, 0, 1, 169};
      device::Buffer row0 = device::upload_new(r0.data(), 32), len = device::upload_new(ln.data(), 32);
      device::Buffer o(size_t(T * HV * V) * 2);
      device::Buffer h0f = put(in.h0, false);  // window 0: the forward's h0 (ht goes to S), kept for the backward
      cuda::ForwardScratch keep;
      cuda::DeviceArgs a;
      a.form = cuda::Form::Chunked;
      a.simt = c.simt;
      a.window = window;
      a.N = 4, a.H = H, a.HV = HV, a.K = K, a.V = V, a.write = var.write, a.decay = var.decay;
      a.io = DType::BF16, a.o_dtype = DType::BF16;
      a.row0 = row0.as<int64_t>(), a.len = len.as<int64_t>(), a.max_len = 169;
      a.q = q.get(), a.k = k.get(), a.v = v.get(), a.beta = beta.as<float>(), a.g = g.as<float>();
      a.h0 = S.as<float>(), a.ht = S.as<float>(), a.o = o.get();
      if (window == 0) a.h0 = h0f.as<float>();
      if (window != 1) a.keep = &keep;
      cuda::forward(a);
      EXPECT_EQ(keep.filled(), window != 1);
      Tensor go = Tensor::empty(ref.o.shape()), ght = Tensor::empty(ref.ht.shape());
      device::download_values(go.f32(), o, go.numel(), device::Storage::BF16);
      device::download_values(ght.f32(), S, ght.numel(), device::Storage::F32);
      const std::string label = std::string(var.name) + (c.simt ? " SIMT" : " TF32") + " K " + std::to_string(K) + " V " +
                                std::to_string(V) +
                                " window " + std::to_string(window);
      expect_close(go, ref.o, 5e-3, label + " o");
      expect_close(ght, ref.ht, 5e-3, label + " ht");

      // Backward in windows against the CPU recurrent backward of the same bf16-rounded q, k, v
      // and do (so only the arithmetic differs).
      DeltaCotangents cot = random_cotangents(var, 1, T, HV, K, V, 4, 22);
      cot.d_o = round_bf16(cot.d_o);
      DeltaInputs rin = in;
      rin.q = round_bf16(in.q), rin.k = round_bf16(in.k), rin.v = round_bf16(in.v);
      const DeltaGrads gr = delta_backward(rin, cot, cpu, Impl::Recurrent);
      device::Buffer h0 = put(in.h0, false), d_o = put(cot.d_o, true), dht = put(cot.dht, false);
      a.h0 = window == 0 ? h0f.as<float>() : h0.as<float>(), a.ht = nullptr;
      auto zeros = [](const Tensor& t) { return t.defined() ? device::zeros_f32(t.numel()) : device::Buffer(); };
      device::Buffer dq = zeros(gr.dq), dk = zeros(gr.dk), dv = zeros(gr.dv), db = zeros(gr.dbeta), dg = zeros(gr.dg),
                     dh0 = zeros(gr.dh0);
      cuda::DeviceGrads dgr;
      dgr.d_o = d_o.get(), dgr.do_dtype = DType::BF16, dgr.dht = dht.as<float>();
      dgr.dq = dq.as<float>(), dgr.dk = dk.as<float>(), dgr.dv = dv.as<float>(), dgr.dbeta = db.as<float>();
      dgr.dg = dg.as<float>(), dgr.dh0 = dh0.as<float>(), dgr.longest = 169;
      cuda::backward(a, dgr);
      EXPECT_EQ(keep.reused, window == 0 ? 1 : 0) << label;
      EXPECT_FALSE(keep.filled()) << label;
      auto got = [](const device::Buffer& b, const Tensor& like) {
        if (!like.defined()) return Tensor();
        Tensor t = Tensor::empty(like.shape());
        device::download_values(t.f32(), b, t.numel(), device::Storage::F32);
        return t;
      };
      expect_close(got(dq, gr.dq), gr.dq, grad_tol, label + " dq");
      expect_close(got(dk, gr.dk), gr.dk, grad_tol, label + " dk");
      expect_close(got(dv, gr.dv), gr.dv, grad_tol, label + " dv");
      expect_close(got(db, gr.dbeta), gr.dbeta, grad_tol, label + " dbeta");
      expect_close(got(dg, gr.dg), gr.dg, grad_tol, label + " dg");
      expect_close(got(dh0, gr.dh0), gr.dh0, grad_tol, label + " dh0");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, DeltaCudaChunked,
                         ::testing::Values(ChunkedCase{true, 64, 80}, ChunkedCase{false, 64, 80},
                                           ChunkedCase{false, 128, 37}, ChunkedCase{false, 32, 20},
                                           ChunkedCase{false, 64, 144}),
                         [](const ::testing::TestParamInfo<ChunkedCase>& p) {
                           return std::string(p.param.simt ? "simt" : "tf32") + "_K" + std::to_string(p.param.K) + "_V" +
                                  std::to_string(p.param.V);
                         });

// The decode step (one token per sequence: max_len 1 picks the decode kernel) through the device
// API in each of its modes, against the CPU recurrent reference: the state updated in place,
// written to a second buffer (h0 left as it was), not written (ht null), bf16 q/k/v/o, and a
// state 4 bytes off 16-byte alignment (the kernel's scalar path), and each sequence's state in its
// own allocation, read and written in place through a pointer array (the model's decode; token
// rows implied by row0 null); K = V = 128 (whole-line loads), K 64 / V 37 (the scalar path's
// shape), K 32 / V 100 (vector loads with a partial second column tile) and K 100 / V 48 (vector
// loads narrower than one tile, rows not a multiple of the 16 row groups).
TEST(DeltaCudaDecode, EveryModeMatchesCpu) {
  for (const Variant& var : kVariants) {
    if (var.normalize == Normalize::On) continue;  // the normaliser is the host wrapper's extra column
    for (const auto& [K, V] : {std::pair<int64_t, int64_t>{128, 128}, {64, 37}, {32, 100}, {100, 48}}) {
      const int64_t N = 5, H = 2, HV = 4, n_state = N * HV * K * V;
      DeltaInputs in = random_inputs(var, 1, N, H, HV, K, V, N, 31);
      in.cu_seqlens = {0, 1, 2, 3, 4, 5};
      const DeltaOptions cpu = testing::options(var);
      const DeltaOutputs ref = delta_forward(in, cpu, Impl::Recurrent);
      DeltaInputs rin = in;  // what the bf16 mode computes from
      rin.q = round_bf16(in.q), rin.k = round_bf16(in.k), rin.v = round_bf16(in.v);
      const DeltaOutputs rref = delta_forward(rin, cpu, Impl::Recurrent);
      const std::vector<int64_t> r0 = {0, 1, 2, 3, 4}, ln = {1, 1, 1, 1, 1};
      device::Buffer row0 = device::upload_new(r0.data(), 40), len = device::upload_new(ln.data(), 40);
      const char* modes[] = {"in place", "new buffer", "no ht", "bf16", "misaligned state", "per-sequence states"};
      for (int mode = 0; mode < 6; ++mode) {
        const bool bf16 = mode == 3;
        const auto io = bf16 ? device::Storage::BF16 : device::Storage::F32;
        auto put = [](const Tensor& t, device::Storage st) {
          return t.defined() ? device::upload_values(t.f32(), t.numel(), st) : device::Buffer();
        };
        device::Buffer q = put(in.q, io), k = put(in.k, io), v = put(in.v, io), beta = put(in.beta, device::Storage::F32),
                       g = put(in.g, device::Storage::F32);
        // The state at offset 1 float in mode 4, at 0 otherwise.
        const int64_t off = mode == 4 ? 1 : 0;
        std::vector<float> host(size_t(n_state + off), 0.0f);
        std::copy(in.h0.f32(), in.h0.f32() + n_state, host.begin() + off);
        device::Buffer S = device::upload_new(host.data(), host.size() * 4), S2(size_t(n_state) * 4);
        device::Buffer o(size_t(N * HV * V) * (bf16 ? 2 : 4));
        cuda::DeviceArgs a;
        a.N = N, a.H = H, a.HV = HV, a.K = K, a.V = V, a.write = var.write, a.decay = var.decay;
        a.io = bf16 ? DType::BF16 : DType::F32, a.o_dtype = a.io;
        a.row0 = row0.as<int64_t>(), a.len = len.as<int64_t>(), a.max_len = 1;
        a.q = q.get(), a.k = k.get(), a.v = v.get(), a.beta = beta.as<float>(), a.g = g.as<float>();
        a.h0 = S.as<float>() + off;
        a.ht = mode == 1 ? S2.as<float>() : mode == 2 ? nullptr : S.as<float>() + off;
        a.o = o.get();
        // Mode 5: the states in separate buffers, allocated last sequence first.
        const int64_t SS = HV * K * V;
        std::vector<device::Buffer> own(static_cast<size_t>(N));
        std::vector<float*> ptrs(static_cast<size_t>(N));
        device::Buffer d_ptrs;
        if (mode == 5) {
          for (int64_t n = N - 1; n >= 0; --n) {
            own[size_t(n)] = device::upload_new(in.h0.f32() + n * SS, size_t(SS) * 4);
            ptrs[size_t(n)] = own[size_t(n)].as<float>();
          }
          d_ptrs = device::upload_new(ptrs.data(), ptrs.size() * sizeof(float*));
          a.states = d_ptrs.as<float* const>();
          a.h0 = a.ht = nullptr;
          a.row0 = a.len = nullptr;
        }
        cuda::forward(a);
        const std::string label = std::string(var.name) + " K " + std::to_string(K) + " V " + std::to_string(V) + " " +
                                  modes[mode];
        const DeltaOutputs& want = bf16 ? rref : ref;
        const double tol = bf16 ? 5e-3 : 1e-4;
        Tensor go = Tensor::empty(want.o.shape());
        device::download_values(go.f32(), o, go.numel(), io);
        expect_close(go, want.o, tol, label + " o");
        std::vector<float> state(host.size());
        device::download(state.data(), S.get(), state.size() * 4);
        Tensor ght = Tensor::empty(want.ht.shape());
        if (mode == 1) device::download(ght.f32(), S2.get(), size_t(n_state) * 4);
        else if (mode == 5)
          for (int64_t n = 0; n < N; ++n) device::download(ght.f32() + n * SS, own[size_t(n)].get(), size_t(SS) * 4);
        else std::copy(state.begin() + off, state.end(), ght.f32());
        if (mode != 2) expect_close(ght, want.ht, tol, label + " ht");
        if (mode == 1 || mode == 2 || mode == 5) {  // h0 read, never written (mode 5: not even read)
          EXPECT_TRUE(std::equal(state.begin(), state.end(), host.begin())) << label << ": h0 changed";
        }
        if (mode == 4) {
          EXPECT_EQ(state[0], 0.0f) << label << ": wrote before the state";
        }
      }
    }
  }
}

// Three decode steps launched back to back on one state (each kernel follows the one that wrote
// the state it reads: the programmatic dependent launch's wait is what orders them), every token
// row list uploaded before the first, against the CPU recurrence over the three-token sequences:
// every step's outputs and the final state. KDA and DeltaNet; K = V = 128 and K 100 / V 48.
TEST(DeltaCudaDecode, StepsBackToBackMatchTheCpu) {
  for (const Variant& var : {kVariants[4], kVariants[2]}) {
    for (const auto& [K, V] : {std::pair<int64_t, int64_t>{128, 128}, {100, 48}}) {
      const int64_t N = 6, T = 3, H = 2, HV = 4;
      DeltaInputs in = random_inputs(var, 1, N * T, H, HV, K, V, N, 53);
      in.cu_seqlens.clear();
      for (int64_t n = 0; n <= N; ++n) in.cu_seqlens.push_back(n * T);
      const DeltaOutputs want = delta_forward(in, testing::options(var), Impl::Recurrent);
      auto put = [](const Tensor& t) {
        return t.defined() ? device::upload_values(t.f32(), t.numel(), device::Storage::F32) : device::Buffer();
      };
      device::Buffer q = put(in.q), k = put(in.k), v = put(in.v), beta = put(in.beta), g = put(in.g);
      device::Buffer S = put(in.h0), o(size_t(N * T * HV * V) * 4);
      std::vector<device::Buffer> rows;
      const std::vector<int64_t> ln(static_cast<size_t>(N), 1);
      device::Buffer len = device::upload_new(ln.data(), ln.size() * 8);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int64_t> r0;
        for (int64_t n = 0; n < N; ++n) r0.push_back(n * T + t);
        rows.push_back(device::upload_new(r0.data(), r0.size() * 8));
      }
      cuda::DeviceArgs a;
      a.N = N, a.H = H, a.HV = HV, a.K = K, a.V = V, a.write = var.write, a.decay = var.decay;
      a.io = DType::F32, a.o_dtype = DType::F32;
      a.len = len.as<int64_t>(), a.max_len = 1;
      a.q = q.get(), a.k = k.get(), a.v = v.get(), a.beta = beta.as<float>(), a.g = g.as<float>();
      a.h0 = a.ht = S.as<float>();
      a.o = o.get();
      for (int64_t t = 0; t < T; ++t) {
        a.row0 = rows[size_t(t)].as<int64_t>();
        cuda::forward(a);
      }
      const std::string label = std::string(var.name) + " K " + std::to_string(K) + " V " + std::to_string(V);
      Tensor go = Tensor::empty(want.o.shape()), ght = Tensor::empty(want.ht.shape());
      device::download_values(go.f32(), o, go.numel(), device::Storage::F32);
      device::download_values(ght.f32(), S, ght.numel(), device::Storage::F32);
      expect_close(go, want.o, 1e-4, label + " o");
      expect_close(ght, want.ht, 1e-4, label + " ht");
    }
  }
}

// The decode step with the layer's activations fused (DecodePrologue: what a delta layer's decode
// hands the kernel) against the CPU recurrence on inputs activated on the host by the reference
// definitions: q/‖q‖ and k/‖k‖ in double precision (eps 1e-6 inside the root), β = σ(logit), and
// g by ops/gates.h's softplus and lower-bound gate forms (the fixture-tested CPU gates). DeltaNet,
// Gated DeltaNet (scalar softplus gate, dt_bias per head) and KDA in both gate forms; grouped
// value heads; K = V = 128, K 64 / V 37 and K 32 / V 100; each sequence's state in its own buffer,
// in place.
TEST(DeltaCudaDecode, FusedActivationsMatchCpu) {
  struct Case {
    Variant var;
    cuda::GateInput gate;
  };
  const Case cases[] = {{kVariants[2], cuda::GateInput::LogDecay},
                        {kVariants[3], cuda::GateInput::Softplus},
                        {kVariants[4], cuda::GateInput::Softplus},
                        {kVariants[4], cuda::GateInput::LowerBound}};
  for (const Case& c : cases) {
    for (const auto& [K, V] : {std::pair<int64_t, int64_t>{128, 128}, {64, 37}, {32, 100}}) {
      const int64_t N = 5, H = 2, HV = 4, SS = HV * K * V;
      Rng rng(77);
      DeltaInputs in = random_inputs(c.var, 1, N, H, HV, K, V, N, 41);
      in.cu_seqlens = {0, 1, 2, 3, 4, 5};
      // Raw activations: q and k of any norm, β's logits, the gate's pre-activations.
      const Tensor q_raw = testing::randn(rng, {1, N, H, K}, 2.0f), k_raw = testing::randn(rng, {1, N, H, K}, 0.5f);
      const Tensor beta_logit = testing::randn(rng, {1, N, HV}, 2.0f);
      const int64_t gk = c.var.decay == Decay::PerChannel ? K : 1;
      const Tensor gate_x = testing::randn(rng, {1, N, HV, gk}, 2.0f);
      const Tensor A_log = testing::uniform(rng, {HV}, -1.0f, 1.0f), dt_bias = testing::randn(rng, {HV * gk}, 0.5f);
      auto l2 = [&](const Tensor& x) {
        Tensor y = Tensor::empty(x.shape());
        for (int64_t r = 0; r < x.numel() / K; ++r) {
          double ss = 0;
          for (int64_t i = 0; i < K; ++i) ss += double(x.f32()[r * K + i]) * x.f32()[r * K + i];
          for (int64_t i = 0; i < K; ++i) y.f32()[r * K + i] = float(x.f32()[r * K + i] / std::sqrt(ss + 1e-6));
        }
        return y;
      };
      in.q = l2(q_raw), in.k = l2(k_raw);
      for (int64_t i = 0; i < in.beta.numel(); ++i) in.beta.f32()[i] = float(1.0 / (1.0 + std::exp(-double(beta_logit.f32()[i]))));
      if (c.gate == cuda::GateInput::Softplus)
        gate_softplus_forward(gate_x.f32(), A_log.f32(), dt_bias.f32(), in.g.f32(), GateShape{N, HV, gk});
      if (c.gate == cuda::GateInput::LowerBound)
        gate_lowerbound_forward(gate_x.f32(), A_log.f32(), dt_bias.f32(), -5.0f, in.g.f32(), GateShape{N, HV, gk});
      const DeltaOutputs ref = delta_forward(in, testing::options(c.var), Impl::Recurrent);

      auto put = [](const Tensor& t) { return device::upload_values(t.f32(), t.numel(), device::Storage::F32); };
      device::Buffer q = put(q_raw), k = put(k_raw), v = put(in.v), beta = put(beta_logit);
      device::Buffer g = c.gate == cuda::GateInput::LogDecay ? device::Buffer() : put(gate_x);
      device::Buffer dA = put(A_log), dbias = put(dt_bias), o(size_t(N * HV * V) * 4);
      std::vector<device::Buffer> own;
      std::vector<float*> ptrs;
      for (int64_t n = 0; n < N; ++n) {
        own.push_back(device::upload_new(in.h0.f32() + n * SS, size_t(SS) * 4));
        ptrs.push_back(own.back().as<float>());
      }
      device::Buffer d_ptrs = device::upload_new(ptrs.data(), ptrs.size() * sizeof(float*));
      cuda::DeviceArgs a;
      a.N = N, a.H = H, a.HV = HV, a.K = K, a.V = V, a.write = c.var.write, a.decay = c.var.decay;
      a.io = DType::F32, a.o_dtype = DType::F32, a.max_len = 1;
      a.q = q.get(), a.k = k.get(), a.v = v.get(), a.beta = beta.as<float>(), a.g = g.as<float>(), a.o = o.get();
      a.states = d_ptrs.as<float* const>();
      a.prologue.l2norm = true;
      a.prologue.beta_logit = true;
      a.prologue.gate = c.gate;
      a.prologue.A_log = dA.as<float>(), a.prologue.dt_bias = dbias.as<float>(), a.prologue.lower_bound = -5.0f;
      cuda::forward(a);
      const std::string label = std::string(c.var.name) + (c.gate == cuda::GateInput::LowerBound ? " lower-bound" : "") +
                                " K " + std::to_string(K) + " V " + std::to_string(V) + " fused activations";
      Tensor go = Tensor::empty(ref.o.shape());
      device::download_values(go.f32(), o, go.numel(), device::Storage::F32);
      expect_close(go, ref.o, 1e-4, label + " o");
      Tensor ght = Tensor::empty(ref.ht.shape());
      for (int64_t n = 0; n < N; ++n) device::download(ght.f32() + n * SS, own[size_t(n)].get(), size_t(SS) * 4);
      expect_close(ght, ref.ht, 1e-4, label + " ht");
    }
  }
  // The activations belong to the decode step: a longer problem refuses them.
  cuda::DeviceArgs a;
  a.N = 1, a.H = a.HV = 1, a.K = a.V = 16, a.max_len = 2;
  a.prologue.l2norm = true;
  EXPECT_THROW(cuda::forward(a), Error);
}

// The differentiable op (ag::delta_rule, what models train through) on the device against the
// CPU chunked form: output and the gradients of q, k, v, β and g, for each variant a k3 model
// trains (linear attention, DeltaNet, Gated DeltaNet, KDA with its gate), grouped value heads
// included, at a length the recurrent kernels take and one the chunked kernels take (Form::Auto,
// as in training). The inputs go through the layer's own ops (l2norm, sigmoid, the KDA gate), whose
// CUDA backward runs too.
TEST(DeltaCudaAutograd, GradientsMatchTheCpu) {
  struct Case {
    const char* name;
    Write write;
    Decay decay;
    int64_t H, HV;
  };
  const Case cases[] = {{"linear", Write::Additive, Decay::None, 2, 2},
                        {"deltanet", Write::Delta, Decay::None, 2, 2},
                        {"gdn", Write::Delta, Decay::Scalar, 2, 4},
                        {"kda", Write::Delta, Decay::PerChannel, 2, 2}};
  const int64_t B = 2, K = 32, V = 24;
  for (const int64_t T : {37, 100})  // one chunk or less: the recurrent kernels; more: the chunked ones
  for (const Case& c : cases) {
    Rng rng(11);
    DeltaOptions o;
    o.write = c.write;
    o.decay = c.decay;
    const ag::DeltaShape s{B, T, c.H, c.HV, K, V};
    const int64_t M = B * T;
    std::vector<Var> in = {k3::testing::rand_var(rng, {M, c.H * K}), k3::testing::rand_var(rng, {M, c.H * K}),
                           k3::testing::rand_var(rng, {M, c.HV * V}), k3::testing::rand_var(rng, {M, c.HV}),
                           k3::testing::rand_var(rng, {M, c.HV * (c.decay == Decay::PerChannel ? K : 1)}),
                           k3::testing::rand_var(rng, {c.HV}, 0.5f), k3::testing::rand_var(rng, {c.HV * K}, 0.5f)};
    std::string what;
    const double d = k3::testing::compare_with_grads(in, [&](const std::vector<Var>& v) {
      Var q = ag::l2norm(v[0], K, 1e-6f), k = ag::l2norm(v[1], K, 1e-6f);
      Var beta = c.write == Write::Delta ? ag::sigmoid(v[3]) : nullptr;
      Var g;
      if (c.decay == Decay::Scalar) g = ag::scale(ag::sigmoid(v[4]), -0.2f);
      if (c.decay == Decay::PerChannel) g = ag::kda_gate(v[4], v[5], v[6], c.HV, K, ag::KdaGateForm::Softplus, 0.0f);
      return ag::delta_rule(q, k, v[2], beta, g, o, s);
    }, &what);
    EXPECT_LT(d, 1e-4) << c.name << " T " << T << ", worst: " << what;
  }
}

}  // namespace
}  // namespace k3::linear
