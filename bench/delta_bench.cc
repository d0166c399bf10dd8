// Throughput of the delta-rule core on the CPU: chunked (WY/UT) vs the recurrent reference.
//   * prefill shapes: B = 1, H = 4, K = V = 64 and 128, T = 1K, 4K, 16K, chunk 64, forward and
//     forward + backward, for KDA (per-channel decay), GDN (scalar decay), DeltaNet (no decay)
//     and linear attention (additive write);
//   * a tiny training shape: B = 16, T = 128, H = 4, K = V = 32, chunk 16.
// Counters: tokens/s (items), and for the forward prefill the per-sequence memory of the fixed
// recurrent state against a softmax KV cache (fp32 K and V for the same heads) at the same T.
// The recurrent backward keeps every state (it is the test reference), so it is only run up to
// T = 4K. Set OPENBLAS_CORETYPE=SkylakeX on AVX-512 machines that Debian's OpenBLAS misdetects.
#include <benchmark/benchmark.h>

#include "core/random.h"
#include "mixers/linear/delta_core.h"

namespace {

using namespace k3;
using namespace k3::linear;

enum class Variant { Kda, Gdn, DeltaNet, LinearAttn };

DeltaOptions options_for(Variant var, int chunk) {
  DeltaOptions o;
  o.chunk = chunk;
  o.write = var == Variant::LinearAttn ? Write::Additive : Write::Delta;
  o.decay = var == Variant::Kda ? Decay::PerChannel : var == Variant::Gdn ? Decay::Scalar : Decay::None;
  return o;
}

DeltaInputs make_inputs(const DeltaOptions& o, int64_t B, int64_t T, int64_t H, int64_t K) {
  Rng rng(1);
  auto fill = [&](Shape s, float lo, float hi) {
    Tensor t = Tensor::empty(std::move(s));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = lo + (hi - lo) * rng.uniform();
    return t;
  };
  DeltaInputs in;
  in.q = fill({B, T, H, K}, -1.0f, 1.0f);  // [B, T, H, K]
  in.k = fill({B, T, H, K}, -0.2f, 0.2f);  // [B, T, H, K], small so that β|k|² < 2
  in.v = fill({B, T, H, K}, -1.0f, 1.0f);  // [B, T, HV, V], V = K
  if (o.write == Write::Delta) in.beta = fill({B, T, H}, 0.0f, 1.0f);  // [B, T, HV]
  if (o.decay == Decay::PerChannel) in.g = fill({B, T, H, K}, -5.0f, 0.0f);
  if (o.decay == Decay::Scalar) in.g = fill({B, T, H}, -5.0f, 0.0f);
  return in;
}

void run(benchmark::State& state, Variant var, Impl impl, bool backward, int64_t B, int chunk) {
  const int64_t T = state.range(0), K = state.range(1), H = 4;
  const DeltaOptions opts = options_for(var, chunk);
  const DeltaInputs in = make_inputs(opts, B, T, H, K);
  DeltaCotangents cot;
  if (backward) {
    Rng rng(2);
    cot.d_o = Tensor::empty({B, T, H, K});
    for (int64_t i = 0; i < cot.d_o.numel(); ++i) cot.d_o.f32()[i] = rng.uniform() - 0.5f;
  }
  for (auto _ : state) {
    DeltaOutputs out = delta_forward(in, opts, impl);
    benchmark::DoNotOptimize(out.o.raw());
    if (backward) {
      DeltaGrads g = delta_backward(in, cot, opts, impl);
      benchmark::DoNotOptimize(g.dq.raw());
    }
  }
  state.SetItemsProcessed(state.iterations() * B * T);
  if (!backward) {
    state.counters["state_bytes"] = double(H * K * K * 4);
    state.counters["kv_cache_bytes"] = double(2 * T * H * K * 4);
  }
}

void prefill_args(benchmark::internal::Benchmark* b) {
  for (int64_t K : {64, 128})
    for (int64_t T : {1024, 4096, 16384}) b->Args({T, K});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}
void prefill_args_short(benchmark::internal::Benchmark* b) {
  for (int64_t K : {64, 128})
    for (int64_t T : {1024, 4096}) b->Args({T, K});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}
void tiny_args(benchmark::internal::Benchmark* b) { b->Args({128, 32})->Unit(benchmark::kMillisecond)->UseRealTime(); }

#define K3_PREFILL(Name, Var)                                                                         \
  void BM_##Name##Chunked(benchmark::State& s) { run(s, Var, Impl::Chunked, false, 1, 64); }          \
  void BM_##Name##Recurrent(benchmark::State& s) { run(s, Var, Impl::Recurrent, false, 1, 64); }      \
  void BM_##Name##ChunkedFwdBwd(benchmark::State& s) { run(s, Var, Impl::Chunked, true, 1, 64); }     \
  void BM_##Name##RecurrentFwdBwd(benchmark::State& s) { run(s, Var, Impl::Recurrent, true, 1, 64); } \
  void BM_Tiny##Name##Chunked(benchmark::State& s) { run(s, Var, Impl::Chunked, false, 16, 16); }     \
  void BM_Tiny##Name##Recurrent(benchmark::State& s) { run(s, Var, Impl::Recurrent, false, 16, 16); } \
  void BM_Tiny##Name##ChunkedFwdBwd(benchmark::State& s) { run(s, Var, Impl::Chunked, true, 16, 16); } \
  void BM_Tiny##Name##RecurrentFwdBwd(benchmark::State& s) { run(s, Var, Impl::Recurrent, true, 16, 16); } \
  BENCHMARK(BM_##Name##Chunked)->Apply(prefill_args);                                                 \
  BENCHMARK(BM_##Name##Recurrent)->Apply(prefill_args);                                               \
  BENCHMARK(BM_##Name##ChunkedFwdBwd)->Apply(prefill_args);                                           \
  BENCHMARK(BM_##Name##RecurrentFwdBwd)->Apply(prefill_args_short);                                   \
  BENCHMARK(BM_Tiny##Name##Chunked)->Apply(tiny_args);                                                \
  BENCHMARK(BM_Tiny##Name##Recurrent)->Apply(tiny_args);                                              \
  BENCHMARK(BM_Tiny##Name##ChunkedFwdBwd)->Apply(tiny_args);                                          \
  BENCHMARK(BM_Tiny##Name##RecurrentFwdBwd)->Apply(tiny_args);

K3_PREFILL(Kda, Variant::Kda)
K3_PREFILL(Gdn, Variant::Gdn)
K3_PREFILL(DeltaNet, Variant::DeltaNet)
K3_PREFILL(LinearAttn, Variant::LinearAttn)

}  // namespace

BENCHMARK_MAIN();
