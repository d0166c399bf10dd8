// Prefill throughput of the delta-rule core on the CPU: chunked (WY/UT) vs the recurrent
// reference, KDA (per-channel decay, the most expensive variant) and GDN (scalar decay), B = 1,
// H = 4, K = V = 64 and 128, T = 1K … 16K. Counters: tokens/s, and the per-sequence memory of the
// fixed recurrent state against a softmax KV cache (fp32 K and V for the same heads) at the same T.
#include <benchmark/benchmark.h>

#include "core/random.h"
#include "mixers/linear/delta_core.h"

namespace {

using namespace k3;
using namespace k3::linear;

DeltaInputs make_inputs(Decay decay, int64_t T, int64_t H, int64_t K) {
  Rng rng(1);
  auto fill = [&](Shape s, float lo, float hi) {
    Tensor t = Tensor::empty(std::move(s));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = lo + (hi - lo) * rng.uniform();
    return t;
  };
  DeltaInputs in;
  in.q = fill({1, T, H, K}, -1.0f, 1.0f);  // [B, T, H, K]
  in.k = fill({1, T, H, K}, -0.2f, 0.2f);  // [B, T, H, K], small so that β|k|² < 2
  in.v = fill({1, T, H, K}, -1.0f, 1.0f);  // [B, T, HV, V], V = K
  in.beta = fill({1, T, H}, 0.0f, 1.0f);   // [B, T, HV]
  in.g = decay == Decay::PerChannel ? fill({1, T, H, K}, -5.0f, 0.0f) : fill({1, T, H}, -5.0f, 0.0f);
  return in;
}

void run(benchmark::State& state, Decay decay, Impl impl) {
  const int64_t T = state.range(0), K = state.range(1), H = 4;
  const DeltaInputs in = make_inputs(decay, T, H, K);
  DeltaOptions opts;
  opts.decay = decay;
  opts.chunk = 64;
  for (auto _ : state) {
    DeltaOutputs out = delta_forward(in, opts, impl);
    benchmark::DoNotOptimize(out.o.raw());
  }
  state.SetItemsProcessed(state.iterations() * T);
  state.counters["state_bytes"] = double(H * K * K * 4);
  state.counters["kv_cache_bytes"] = double(2 * T * H * K * 4);
}

void args(benchmark::internal::Benchmark* b) {
  for (int64_t K : {64, 128})
    for (int64_t T : {1024, 2048, 4096, 8192, 16384}) b->Args({T, K});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

void BM_KdaChunked(benchmark::State& s) { run(s, Decay::PerChannel, Impl::Chunked); }
void BM_KdaRecurrent(benchmark::State& s) { run(s, Decay::PerChannel, Impl::Recurrent); }
void BM_GdnChunked(benchmark::State& s) { run(s, Decay::Scalar, Impl::Chunked); }
void BM_GdnRecurrent(benchmark::State& s) { run(s, Decay::Scalar, Impl::Recurrent); }

BENCHMARK(BM_KdaChunked)->Apply(args);
BENCHMARK(BM_KdaRecurrent)->Apply(args);
BENCHMARK(BM_GdnChunked)->Apply(args);
BENCHMARK(BM_GdnRecurrent)->Apply(args);

}  // namespace

BENCHMARK_MAIN();
