// k3 bench: measurements that print figures beside their anchors and physical limits.
//   k3 bench decode     decode tokens/s at given contexts vs the memory-bandwidth roofline
//   k3 bench bandwidth  this machine's read bandwidth (the CPU decode ceiling)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <vector>

#include "cli/commands.h"
#include "cli/format.h"
#include "core/parallel.h"
#include "core/random.h"
#include "models/registry.h"

namespace k3::cli {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Read bandwidth in bytes/s: best of several passes summing a buffer much larger than the caches.
double measure_read_bandwidth(size_t bytes) {
  size_t n = bytes / sizeof(float);
  std::vector<float> buf(n);
  parallel_for(int64_t(n), 1 << 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) buf[size_t(i)] = float(i & 1023);
  });
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t = clock_type::now();
    float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (int64_t i = 0; i < int64_t(n); ++i) total += buf[size_t(i)];
    double s = seconds_since(t);
    sink = sink + total;
    best = std::max(best, double(n * sizeof(float)) / s);
  }
  return best;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      v.push_back(std::stoll(item));
    } catch (const std::exception&) {
      throw error("bench", "'", item, "' is not an integer in list '", s, "'");
    }
    if (v.back() <= 0) throw error("bench", "list '", s, "' must hold positive integers");
  }
  return v;
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks that print figures beside their anchors and limits");
  bench->require_subcommand(1);

  auto* bwc = bench->add_subcommand("bandwidth", "Measure this machine's read bandwidth (the CPU decode ceiling)");
  static RuntimeOptions bw_rt;
  add_runtime_options(bwc, bw_rt);
  bwc->callback([] {
    apply_runtime_options(bw_rt);
    double b = measure_read_bandwidth(size_t(512) << 20);
    std::printf("read bandwidth: %.2f GB/s with %d threads (512 MiB read-sum, best of 5)\n", b / 1e9, num_threads());
  });

  auto* dec = bench->add_subcommand("decode", "Decode tokens/s at several contexts against the bandwidth roofline");
  static std::string preset = "gpt2", contexts = "128,1024";
  static int64_t steps = 32;
  static RuntimeOptions rt;
  dec->add_option("--preset", preset, "Model preset (random weights at the real shape)")->capture_default_str();
  dec->add_option("--context", contexts, "Comma-separated context lengths")->capture_default_str();
  dec->add_option("--steps", steps, "Decode steps timed per context")->capture_default_str()->check(CLI::PositiveNumber);
  add_runtime_options(dec, rt);
  dec->callback([] {
    apply_runtime_options(rt);
    auto model = build_model(preset_config(preset), preset);
    model->init_random(1);
    const int64_t V = model->vocab_size();
    // Bytes a decode step must read: every weight except the position table (one row).
    double weight_bytes = 0;
    model->visit([&](const std::string& name, Node& p, ParamKind) {
      if (name != "wpe.weight") weight_bytes += double(p.value.nbytes());
    });
    double kv_per_token = 0;
    for (const auto& lm : model->memory_layers()) kv_per_token += lm.spec.per_token_bytes;
    double bw = measure_read_bandwidth(size_t(512) << 20);
    std::printf("model %s: %s params, %s of fp32 weights read per token; KV %s per context token\n", preset.c_str(),
                with_commas(model->total_params()).c_str(), human_bytes(weight_bytes).c_str(),
                human_bytes(kv_per_token).c_str());
    std::printf("measured read bandwidth: %.2f GB/s (%d threads)\n\n", bw / 1e9, num_threads());
    std::printf("%8s %12s %14s %12s %10s\n", "context", "tok/s", "roofline tok/s", "of roofline", "ms/token");
    Rng rng(7);
    for (int64_t ctx_len : parse_list(contexts)) {
      if (ctx_len + steps > model->max_positions())
        throw error("bench", "context ", ctx_len, " + ", steps, " steps exceeds the model's ", model->max_positions(), " positions");
      std::vector<int64_t> prompt(static_cast<size_t>(ctx_len));
      for (auto& t : prompt) t = int64_t(rng.below(uint64_t(V)));
      Context c = model->new_context(ctx_len + steps);
      std::vector<float> logits(static_cast<size_t>(V));
      model->forward(prompt.data(), ctx_len, &c, logits.data(), Logits::Last);
      int64_t next = 0;
      model->forward(&next, 1, &c, logits.data(), Logits::Last);  // warm-up step
      auto t = clock_type::now();
      for (int64_t s = 1; s < steps; ++s) {
        next = int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
        model->forward(&next, 1, &c, logits.data(), Logits::Last);
      }
      double sec = seconds_since(t) / double(steps - 1);
      double mid_ctx = double(ctx_len) + double(steps) / 2;
      double roof = bw / (weight_bytes + kv_per_token * mid_ctx);
      std::printf("%8lld %12.1f %14.1f %11.0f%% %10.2f\n", (long long)ctx_len, 1.0 / sec, roof, 100.0 / sec / roof,
                  sec * 1e3);
    }
    std::printf("\nroofline = read bandwidth / (weight bytes + KV bytes at the context); target >= 70%%\n");
  });
}

}  // namespace k3::cli
