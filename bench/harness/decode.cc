// The harnesses of `k3 bench bandwidth`, `k3 bench train`, `k3 bench decode` and `k3 bench
// prefill`: figures printed beside this machine's measured ceilings (read bandwidth or device copy
// rate, GEMM peak).
#include "bench/harness/decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/format.h"
#include "core/parallel.h"
#include "core/profile.h"
#include "core/random.h"
#include "infer/sampler.h"
#include "models/registry.h"
#include "ops/gemm.h"
#include "ops/ops_cuda.h"
#include "train/optimizer.h"

namespace k3::bench {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// A preset's config, cut to its first `layers` layers where asked.
Json bench_config(const std::string& preset, int64_t layers) {
  const Json c = preset_config(preset);
  return layers > 0 ? first_layers(c, layers, preset) : c;
}

// The best of a few square GEMMs through the GEMM the models use: the host's BLAS (1024³ fp32), or
// cuBLASLt on the device (8192³, bf16 or fp32 operands as the weights are stored).
double measure_gemm_flops(bool gpu, bool bf16) {
  if (gpu) {
    if constexpr (device::kCudaBuilt) {
      const int64_t n = 8192;
      const auto st = bf16 ? device::Storage::BF16 : device::Storage::F32;
      const size_t bytes = size_t(n * n) * (bf16 ? 2 : 4);
      device::Buffer A(bytes), B(bytes), C(size_t(n * n) * 4);
      device::zero(A.get(), bytes), device::zero(B.get(), bytes);
      auto run = [&] {
        cuda::gemm(cuda::Op::N, cuda::Op::N, n, n, n, 1.0f, A.get(), 0, B.get(), 0, 0.0f, C.as<float>(), 0, st);
      };
      run();
      double best = 0;
      for (int r = 0; r < 3; ++r) {
        device::Timer t;
        t.start();
        run();
        best = std::max(best, 2.0 * double(n) * n * n / (t.stop_ms() * 1e-3));
      }
      return best;
    }
  }
  const int64_t n = 1024;
  std::vector<float> A(static_cast<size_t>(n * n), 0.5f), B(A.size(), 0.25f), C(A.size());
  double peak = 0;
  for (int r = 0; r < 4; ++r) {
    auto t = clock_type::now();
    gemm(Trans::No, Trans::No, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
    peak = std::max(peak, 2.0 * double(n * n * n) / seconds_since(t));
  }
  return peak;
}

}  // namespace

double measure_device_bandwidth() {
  const size_t n = size_t(1) << 30;
  device::Buffer a(n), b(n);
  device::copy(b.get(), a.get(), n);  // warm-up
  device::Timer t;
  t.start();
  for (int i = 0; i < 5; ++i) device::copy(b.get(), a.get(), n);
  return 2.0 * double(n) * 5 / (t.stop_ms() * 1e-3);
}

double measure_read_bandwidth(size_t bytes) {
  size_t n = bytes / sizeof(float);
  std::vector<float> buf(n);
  parallel_for(int64_t(n), 1 << 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) buf[size_t(i)] = float(i & 1023);
  });
  double best = 0;
  volatile float sink = 0;
  const int64_t nt = num_threads();
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> partial(static_cast<size_t>(nt) * 16, 0.0f);
    auto t = clock_type::now();
    // One contiguous slice per thread, 16 independent accumulators so the adds are not a
    // latency chain: the loop is bound by memory, as decode is.
#pragma omp parallel num_threads(int(nt))
    {
      const int64_t id = omp_get_thread_num(), k = omp_get_num_threads();
      const int64_t a = int64_t(n) * id / k, b = int64_t(n) * (id + 1) / k;
      float acc[16] = {};
      int64_t i = a;
      for (; i + 16 <= b; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += buf[size_t(i + j)];
      for (; i < b; ++i) acc[0] += buf[size_t(i)];
      for (int j = 0; j < 16; ++j) partial[size_t(id * 16 + j)] = acc[j];
    }
    double s = seconds_since(t);
    for (float p : partial) sink = sink + p;
    best = std::max(best, double(n * sizeof(float)) / s);
  }
  return best;
}

void run_train_bench(const TrainBenchOptions& o) {
  const double peak = measure_gemm_flops(false, false);  // the same BLAS
  std::printf("measured sgemm peak: %.1f GFLOP/s (%d threads, 1024^3)\n\n", peak / 1e9, num_threads());
  std::printf("%-14s %12s %10s %12s %14s %10s\n", "preset", "params", "tok/s", "ms/step", "GFLOP/s", "of peak");
  for (const std::string& p : o.presets) {
    auto model = build_model(preset_config(p), p);
    model->init_random(1);
    const int64_t V = model->vocab_size(), M = o.batch * o.seq_len;
    std::vector<int64_t> ids(static_cast<size_t>(M)), targets(ids.size());
    Rng rng(3);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(rng.below(uint64_t(V))), targets[i] = int64_t(rng.below(uint64_t(V)));
    AdamW opt(AdamWOptions{});
    auto step = [&] {
      zero_grad(*model);
      Recording rec;
      Var l = model->loss(TokenBatch{ids.data(), o.batch, o.seq_len, nullptr}, targets);
      backward(l);
      clip_grad_norm(*model, 1.0);
      opt.step(*model, 1e-4f);
    };
    step();  // warm-up
    auto t = clock_type::now();
    for (int64_t s = 0; s < o.steps; ++s) step();
    const double sec = seconds_since(t) / double(o.steps);
    // Useful work: 6 FLOPs per active parameter per token (forward + backward; embedding
    // lookups excluded, the LM head included) plus causal attention's 6·T·d per token per
    // attention layer, counted for softmax-attention presets only.
    double flops = 6.0 * double(model->active_params()) * double(M);
    if (model->architecture() == "gpt2")
      flops += 6.0 * double(model->num_layers()) * double(M) * double(o.seq_len) * double(model->config_json()["n_embd"].get<int64_t>()) / 2.0 * 2.0;
    std::printf("%-14s %12s %10.0f %12.1f %14.2f %9.1f%%\n", p.c_str(), with_commas(model->total_params()).c_str(),
                double(M) / sec, sec * 1e3, flops / sec / 1e9, 100.0 * flops / sec / peak);
  }
  std::printf("\nFLOPs = 6 x active parameters x tokens (+ attention for softmax models); peak = measured sgemm\n");
}

void run_decode_bench(const DecodeBenchOptions& o) {
  const bool gpu = o.gpu;
  const double bw = gpu ? measure_device_bandwidth() : measure_read_bandwidth(size_t(512) << 20);
  if (gpu)
    std::printf("%s; measured device copy: %.0f GB/s (read + write)\n", device::describe(), bw / 1e9);
  else
    std::printf("measured read bandwidth: %.2f GB/s (%d threads)\n", bw / 1e9, num_threads());
  const std::vector<int64_t>& ctxs = o.contexts;
  std::vector<std::string> names = {o.preset};
  if (!o.versus.empty()) names.push_back(o.versus);
  std::vector<std::vector<double>> tps(names.size()), roofs(names.size());
  std::vector<std::vector<int64_t>> batches(names.size());
  const bool budget = o.memory_mb > 0;
  const double budget_bytes = o.memory_mb * 1048576.0;
  if (budget) std::printf("memory budget: %s for the sequences' memories; batch = the sequences that fit\n",
                          human_bytes(budget_bytes).c_str());
  for (size_t k = 0; k < names.size(); ++k) {
    auto model = build_model(bench_config(names[k], o.layers), names[k]);
    model->init_random(1);
    move_to(*model, gpu ? Device::CUDA : Device::CPU, o.weights);  // weights and memories
    // Bytes a decode step of n sequences must read: every weight but the embedding tables (n rows
    // of them) and the routed experts no sequence picked (expected under uniform routing).
    double all_weight_bytes = 0, all_params = 0;
    model->visit([&](const std::string& name, Node& p, ParamKind) {
      if (name != "wpe.weight") all_weight_bytes += double(p.value.nbytes()), all_params += double(p.value.numel());
    });
    const double active = double(model->active_params()), idle1 = model->idle_expert_params(1);
    auto step_weight_bytes = [&](int64_t n) {
      return all_weight_bytes * std::min(1.0, (active + idle1 - model->idle_expert_params(n)) / all_params);
    };
    const double weight_bytes = step_weight_bytes(1);
    double per_token = 0, fixed = 0;
    for (const auto& lm : model->memory_layers()) {
      per_token += lm.spec.per_token_bytes;
      fixed += lm.spec.fixed_bytes;
    }
    const std::string label =
        names[k] + (o.layers > 0 ? " (first " + std::to_string(o.layers) + " layers at full width)" : std::string());
    std::printf("\n%s: %s params, %s of weights read for one token; memory %s/context token + %s fixed\n", label.c_str(),
                with_commas(model->total_params()).c_str(), human_bytes(weight_bytes).c_str(),
                human_bytes(per_token).c_str(), human_bytes(fixed).c_str());
    std::printf("%8s %7s %12s %14s %12s %10s\n", "context", "batch", "tok/s", "roofline tok/s", "of roofline", "ms/step");
    for (int64_t c : ctxs) {
      // Three warm-up steps (the allocator's cache, GEMM plans and clocks settle), then the timed
      // ones, then the profiled ones.
      constexpr int64_t kWarmup = 3;
      const int64_t all_steps = kWarmup - 1 + (o.profile || o.profile_host ? 2 * o.steps : o.steps);
      // A sequence's memories once the run has decoded all its steps.
      const double seq_bytes = fixed + per_token * double(c + all_steps);
      const int64_t nb =
          budget ? std::min<int64_t>(kMaxDecodeBatch, int64_t(std::floor(budget_bytes / seq_bytes))) : o.batch;
      batches[k].push_back(nb);
      if (c + all_steps > model->max_positions() || nb < 1) {
        if (c + all_steps > model->max_positions())
          std::printf("%8lld %7s %12s   (beyond the model's %lld positions)\n", (long long)c, "-", "-",
                      (long long)model->max_positions());
        else
          std::printf("%8lld %7s %12s   (one sequence needs %s, over the budget)\n", (long long)c, "0", "-",
                      human_bytes(seq_bytes).c_str());
        tps[k].push_back(0);
        roofs[k].push_back(0);
        continue;
      }
      // The context is filled with zero tokens (the memories allocate and read exactly what a
      // real prefill leaves behind), then `steps` tokens are decoded.
      std::vector<Context> cx;
      std::vector<Context*> cp;
      for (int64_t b = 0; b < nb; ++b) {
        cx.push_back(model->new_context(c + all_steps));
        for (auto& m : cx.back().layers) m->extend_zeros(c);
        cx.back().position = c;
      }
      for (auto& x : cx) cp.push_back(&x);
      // Greedy decoding: each step's tokens are the last step's picks (on the device, only the
      // ids come back). With --temperature, the last position's logits come back and each
      // sequence's own sampler draws from them.
      std::vector<int64_t> next(static_cast<size_t>(nb), 1), fed(next);
      const bool sampled = o.temperature > 0;
      const int64_t V = model->vocab_size();
      std::vector<float> logits(static_cast<size_t>(sampled ? nb * V : 0));
      const device::HostPin pin = gpu ? device::HostPin(logits.data(), logits.size() * sizeof(float)) : device::HostPin();
      std::vector<Sampler> samplers;
      for (int64_t b = 0; sampled && b < nb; ++b) {
        SamplingOptions so;
        so.temperature = float(o.temperature), so.seed = uint64_t(b + 1);
        samplers.emplace_back(so);
      }
      Decoder decoder(*model, cp, !o.no_graph, sampled ? Decoder::Output::Logits : Decoder::Output::Picks);
      const std::vector<int64_t> no_history;
      auto step = [&] {
        fed.swap(next);
        if (!sampled) return decoder.step(fed.data(), next.data());
        decoder.step(fed.data(), logits.data());
        parallel_for(nb, 1, [&](int64_t b0, int64_t b1) {  // on the thread pool, as serve draws
          for (int64_t b = b0; b < b1; ++b)
            next[size_t(b)] = samplers[size_t(b)].sample(logits.data() + b * V, V, no_history);
        });
      };
      for (int64_t s = 0; s < kWarmup; ++s) step();
      if (sampled && c == ctxs.front())
        std::printf("  (tokens sampled at temperature %g: the step brings back %lld x %lld logits)\n", o.temperature,
                    (long long)nb, (long long)V);
      if (gpu && !o.no_graph && c == ctxs.front())
        std::printf("%s\n", decoder.replaying() ? "  (each step replayed as one CUDA graph; --no-graph queues them)"
                                                 : ("  (no CUDA graph: " + decoder.refusal() + ")").c_str());
      auto t = clock_type::now();
      for (int64_t s = 1; s < o.steps; ++s) step();
      const double sec = seconds_since(t) / double(o.steps - 1);  // logits come back each step: synchronised
      // State read + written, KV read, per sequence; tokens per second over the batch.
      const double roof = double(nb) * bw / (step_weight_bytes(nb) + double(nb) * (fixed * 2 + per_token * double(c)));
      const double tok_s = double(nb) / sec;
      tps[k].push_back(tok_s);
      roofs[k].push_back(roof);
      std::printf("%8lld %7lld %12.1f %14.1f %11.0f%% %10.2f\n", (long long)c, (long long)nb, tok_s, roof, 100.0 * tok_s / roof, sec * 1e3);
      if (o.profile || o.profile_host) {
        const bool drain = gpu && !o.profile_host;
        profile::reset();
        profile::enable(drain);
        auto t2 = clock_type::now();
        for (int64_t s = 0; s < o.steps; ++s) {  // scope by scope: queued from the host, not replayed
          profile::Scope one("step");
          fed.swap(next);
          model->greedy(TokenBatch{fed.data(), nb, 1, cp.data()}, next.data());
        }
        const double wall = seconds_since(t2);
        profile::disable();
        std::printf("\n  where a step goes at context %lld (%lld profiled steps, %.2f ms/step with %s):\n", (long long)c,
                    (long long)o.steps, 1e3 * wall / double(o.steps),
                    drain ? "the device drained at every scope boundary"
                    : gpu ? "host time to queue each scope's work" : "host timing");
        std::string table = profile::format_table(double(o.steps), wall);
        for (size_t at = 0; at < table.size();) {  // indent the table under its row
          const size_t nl = table.find('\n', at);
          std::printf("  %s\n", table.substr(at, nl - at).c_str());
          at = nl == std::string::npos ? table.size() : nl + 1;
        }
        std::printf("\n");
      }
    }
  }
  if (names.size() == 2) {
    // The roofline ratio bounds the speed-up: both models read their weights and memories at the
    // same rate, so no kernel work moves the measured ratio past it. Under a memory budget each
    // model runs the batch that fits, and the ratio counts that too.
    std::printf("\n%8s %16s %14s %18s\n", "context", budget ? "batches" : "batch",
                ("speed-up " + names[1] + " / " + names[0]).c_str(), "roofline ratio");
    for (size_t i = 0; i < ctxs.size(); ++i)
      if (tps[0][i] > 0 && tps[1][i] > 0) {
        const std::string b = std::to_string(batches[0][i]) + (budget ? " / " + std::to_string(batches[1][i]) : "");
        std::printf("%8lld %16s %13.2fx %17.2fx\n", (long long)ctxs[i], b.c_str(), tps[1][i] / tps[0][i],
                    roofs[1][i] / roofs[0][i]);
      }
  }
  std::printf("\nroofline = %s / (weight bytes the step reads, routed experts as uniform routing picks them, + state bytes read and written + KV bytes at the context)\n",
              gpu ? "device copy rate" : "read bandwidth");
}

void run_prefill_bench(const PrefillBenchOptions& o) {
  // Block-format weights go through bf16 GEMMs on the device (ops/ops_cuda.h, dequantize_to_bf16).
  const bool bf16 = o.weights.gemm == DType::BF16 || is_block_dtype(o.weights.quantize);
  const double peak = measure_gemm_flops(o.gpu, bf16);
  if (o.gpu)
    std::printf("%s; measured cuBLASLt %s GEMM 8192^3: %.0f TFLOP/s\n", device::describe(), bf16 ? "bf16" : "fp32",
                peak / 1e12);
  else
    std::printf("measured sgemm peak: %.1f GFLOP/s (%d threads, 1024^3)\n", peak / 1e9, num_threads());
  auto model = build_model(bench_config(o.preset, o.layers), o.preset);
  model->init_random(1);
  move_to(*model, o.gpu ? Device::CUDA : Device::CPU, o.weights);
  // The head runs for each prompt's last position only.
  const double head = double(model->head_weight()->value.numel()), active = double(model->active_params()) - head;
  std::printf("\n%s%s: %s params, %s active per prompt token (the head apart)\n", o.preset.c_str(),
              o.layers > 0 ? (", first " + std::to_string(o.layers) + " layers at full width").c_str() : "",
              with_commas(model->total_params()).c_str(), with_commas(int64_t(active)).c_str());
  std::printf("%8s %6s %12s %14s %12s %10s\n", "seq_len", "batch", "tok/s", "roofline tok/s", "of roofline", "ms");
  const int64_t V = model->vocab_size();
  for (int64_t T : o.seq_lens) {
    if (T > model->max_positions()) {
      std::printf("%8lld %6s %12s   (beyond the model's %lld positions)\n", (long long)T, "-", "-",
                  (long long)model->max_positions());
      continue;
    }
    std::vector<int64_t> ids(static_cast<size_t>(o.batch * T));
    Rng rng(5);
    for (auto& id : ids) id = int64_t(rng.below(uint64_t(V)));
    std::vector<float> last(static_cast<size_t>(o.batch * V));
    // Each prefill from empty memories, as a new request's; the first one warms up.
    auto prefill = [&] {
      std::vector<Context> cx;
      std::vector<Context*> cp;
      for (int64_t b = 0; b < o.batch; ++b) cx.push_back(model->new_context(T));
      for (auto& x : cx) cp.push_back(&x);
      model->logits(TokenBatch{ids.data(), o.batch, T, cp.data()}, last.data(), Logits::Last);
    };
    prefill();
    double best = 1e30;
    for (int64_t r = 0; r < o.reps; ++r) {
      auto t = clock_type::now();
      prefill();  // the logits come back: synchronised
      best = std::min(best, seconds_since(t));
    }
    const double tokens = double(o.batch * T);
    const double roof = tokens / ((2.0 * active * tokens + 2.0 * head * double(o.batch)) / peak);
    std::printf("%8lld %6lld %12.0f %14.0f %11.1f%% %10.2f\n", (long long)T, (long long)o.batch, tokens / best, roof,
                100.0 * tokens / best / roof, best * 1e3);
  }
  std::printf("\nroofline = tokens / (2 FLOPs x active parameters x tokens + the head's at each last position, at the "
              "GEMM peak): the weights' products alone (attention's and the recurrences' work is extra); best of %lld "
              "prefills\n",
              (long long)o.reps);
}

}  // namespace k3::bench
