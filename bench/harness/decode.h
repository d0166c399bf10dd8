// The harnesses of `k3 bench bandwidth`, `k3 bench train`, `k3 bench decode` and `k3 bench
// prefill` (decode.cc). The CLI parses flags (and applies the runtime options: threads, device)
// and calls these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace k3::bench {

constexpr int64_t kMaxDecodeBatch = 4096;

// This machine's read bandwidth in bytes/s: the best of several passes summing `bytes`, much more
// than the caches hold (the CPU decode ceiling).
double measure_read_bandwidth(size_t bytes);
// The GPU's device-to-device copy rate, bytes read + written per second (the decode ceiling there).
double measure_device_bandwidth();

struct TrainBenchOptions {
  std::vector<std::string> presets = {"gpt2-small", "k3-small"};
  int64_t batch = 8, seq_len = 256, steps = 4;
};
// Training tokens/s and achieved FLOP/s of each preset against the measured sgemm peak.
void run_train_bench(const TrainBenchOptions& o);

struct DecodeBenchOptions {
  std::string preset = "gpt2", versus;  // versus: a second preset timed at the same contexts
  int64_t layers = 0;                   // > 0: the presets' first `layers` layers only (models/registry.h)
  std::vector<int64_t> contexts = {128, 1024};
  int64_t steps = 16, batch = 1;
  double memory_mb = 0;    // > 0: each model decodes as many sequences as fit (instead of batch)
  double temperature = 0;  // > 0: sampled steps (B·V logits back to the host)
  bool gpu = false;
  WeightStorage weights;  // GEMM weight storage (bf16 on CUDA) and --quantize's block format
  bool profile = false, profile_host = false, no_graph = false;
};
// Decode tokens/s at each context beside the bandwidth roofline (and, with versus, the speed-up).
void run_decode_bench(const DecodeBenchOptions& o);

struct PrefillBenchOptions {
  std::string preset = "gpt2";
  int64_t layers = 0;  // > 0: the preset's first `layers` layers only
  std::vector<int64_t> seq_lens = {512, 4096};
  int64_t batch = 1, reps = 3;
  bool gpu = false;
  WeightStorage weights;
};
// Prefill tokens/s (B prompts of T tokens from empty memories, the last position's logits) beside
// the compute roofline: 2 FLOPs per active parameter per token against the measured GEMM peak.
void run_prefill_bench(const PrefillBenchOptions& o);

}  // namespace k3::bench
