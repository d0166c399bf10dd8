// k3 bench: measurements that print figures beside their anchors and physical limits (the
// harnesses are in bench/harness/).
//   k3 bench decode     decode tokens/s at given contexts vs the memory-bandwidth roofline
//   k3 bench prefill    prefill tokens/s at given lengths vs the GEMM-peak roofline
//   k3 bench train      training tokens/s and FLOP/s vs the measured sgemm peak
//   k3 bench bandwidth  this machine's read bandwidth (the CPU decode ceiling)
#include <sstream>
#include <string>
#include <vector>

#include "bench/harness/decode.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"

namespace k3::cli {

namespace {

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
  register_bench_recall(bench);
  register_bench_memory(bench);
  register_bench_kernels(bench);

  auto* bwc = bench->add_subcommand("bandwidth", "Measure this machine's read bandwidth (the CPU decode ceiling)");
  static RuntimeOptions bw_rt;
  add_runtime_options(bwc, bw_rt);
  bwc->callback([] {
    apply_runtime_options(bw_rt);
    double b = bench::measure_read_bandwidth(size_t(512) << 20);
    std::printf("read bandwidth: %.2f GB/s with %d threads (512 MiB read-sum, best of 5)\n", b / 1e9, num_threads());
  });

  auto* tr = bench->add_subcommand("train", "Training tokens/s and achieved FLOP/s against this machine's measured sgemm peak");
  static std::string tr_presets = "gpt2-small,k3-small";
  static int64_t tr_batch = 8, tr_seq = 256, tr_steps = 4;
  static RuntimeOptions tr_rt;
  tr->add_option("--presets", tr_presets, "Comma-separated trainable presets")->capture_default_str();
  tr->add_option("--batch", tr_batch, "Sequences per step")->capture_default_str();
  tr->add_option("--seq-len", tr_seq, "Tokens per sequence")->capture_default_str();
  tr->add_option("--steps", tr_steps, "Timed steps (after one warm-up)")->capture_default_str()->check(CLI::PositiveNumber);
  add_runtime_options(tr, tr_rt);
  tr->callback([] {
    apply_runtime_options(tr_rt);
    bench::TrainBenchOptions o;
    o.presets.clear();
    std::stringstream ss(tr_presets);
    for (std::string p; std::getline(ss, p, ',');) o.presets.push_back(p);
    o.batch = tr_batch, o.seq_len = tr_seq, o.steps = tr_steps;
    bench::run_train_bench(o);
  });

  auto* dec = bench->add_subcommand(
      "decode", "Decode tokens/s against context length, beside the bandwidth roofline; --versus compares two models");
  static std::string preset = "gpt2", versus, contexts = "128,1024";
  static int64_t steps = 16, batch = 1;
  static RuntimeOptions rt;
  static std::string cache_dtype = "f32", dtype = "f32";
  static bool profile_steps = false, profile_host = false, no_graph = false;
  static double memory_mb = 0, temperature = 0;
  auto* batch_opt = dec->add_option("--batch", batch, "Sequences decoded together, each at the context (tok/s counts all)")
                        ->capture_default_str()
                        ->check(CLI::Range(int64_t(1), bench::kMaxDecodeBatch));
  dec->add_option("--memory-mb", memory_mb,
                  "Instead of --batch: a budget for the sequences' memories (KV/latent caches, states, conv tails); "
                  "each model decodes as many sequences as fit at each context (at most 4096), so --versus compares "
                  "throughput at equal memory, where a smaller memory buys a larger batch")
      ->check(CLI::PositiveNumber)
      ->excludes(batch_opt);
  dec->add_option("--preset", preset, "Model preset (random weights at the real shape)")->capture_default_str();
  dec->add_option("--versus", versus, "A second preset to time at the same contexts (e.g. --preset k3-small-attn --versus k3-small)");
  static int64_t dec_layers = 0;
  dec->add_option("--layers", dec_layers,
                  "Only the preset's first N layers, at full width (a real-width slice of a model too large to "
                  "instantiate whole, e.g. --preset qwen3-next-80b --layers 4)")
      ->check(CLI::PositiveNumber);
  dec->add_option("--context", contexts, "Comma-separated context lengths")->capture_default_str();
  dec->add_option("--steps", steps, "Decode steps timed per context")->capture_default_str()->check(CLI::Range(2, 100000));
  dec->add_option("--dtype", dtype, "GEMM weight storage on CUDA: f32, or bf16 (fp32 accumulation; the roofline counts the bytes as stored)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  add_cache_dtype_option(dec, cache_dtype);
  static std::string quantize = "none";
  add_quantize_option(dec, quantize);
  dec->add_flag("--profile", profile_steps,
                "After the timed steps, time as many again scope by scope (mixers, their memories, experts, head) "
                "and print where a step goes; each scope boundary waits for the device, so those steps run slower");
  dec->add_flag("--profile-host", profile_host,
                "As --profile, but without waiting for the device: each scope's time is what the host takes to queue "
                "its work (and any wait inside it), which shows where a launch-bound step goes");
  dec->add_option("--temperature", temperature,
                  "Sample each step's tokens at this temperature (0: greedy picks); the step then brings back B·V "
                  "logits and the host samples them, as serve does for sampled requests")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  dec->add_flag("--no-graph", no_graph,
                "On CUDA, queue every step's kernels from the host instead of replaying the step as a CUDA graph "
                "(the graph is captured on the second step; models whose step cannot be replayed run without it "
                "and say why)");
  add_runtime_options(dec, rt);
  dec->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    apply_cache_dtype(cache_dtype, rt, "bench decode");
    const bool gpu = rt.device == "cuda";
    bench::DecodeBenchOptions o;
    o.weights = weight_storage(dtype, quantize, rt, "bench decode");
    o.preset = preset, o.versus = versus, o.contexts = parse_list(contexts), o.layers = dec_layers;
    o.steps = steps, o.batch = batch, o.memory_mb = memory_mb, o.temperature = temperature;
    o.gpu = gpu;
    o.profile = profile_steps, o.profile_host = profile_host, o.no_graph = no_graph;
    bench::run_decode_bench(o);
  });

  auto* pre = bench->add_subcommand("prefill", "Prefill tokens/s against the GEMM-peak roofline, at a preset's real shape");
  static std::string pre_preset = "gpt2", pre_lens = "512,4096", pre_dtype = "f32";
  static int64_t pre_layers = 0, pre_batch = 1, pre_reps = 3;
  static RuntimeOptions pre_rt;
  pre->add_option("--preset", pre_preset, "Model preset (random weights at the real shape)")->capture_default_str();
  pre->add_option("--layers", pre_layers, "Only the preset's first N layers, at full width (a real-width slice)")
      ->check(CLI::PositiveNumber);
  pre->add_option("--seq-len", pre_lens, "Comma-separated prompt lengths")->capture_default_str();
  pre->add_option("--batch", pre_batch, "Prompts prefilled together")->capture_default_str()->check(CLI::Range(1, 1024));
  pre->add_option("--reps", pre_reps, "Timed prefills per length (the best is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  pre->add_option("--dtype", pre_dtype, "GEMM weight storage on CUDA: f32, or bf16 (fp32 accumulation)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  static std::string pre_quantize = "none";
  add_quantize_option(pre, pre_quantize);
  add_runtime_options(pre, pre_rt);
  pre->callback([] {
    apply_runtime_options(pre_rt, DeviceSupport::CpuAndCuda);
    const bool gpu = pre_rt.device == "cuda";
    bench::PrefillBenchOptions o;
    o.weights = weight_storage(pre_dtype, pre_quantize, pre_rt, "bench prefill");
    o.preset = pre_preset, o.layers = pre_layers, o.seq_lens = parse_list(pre_lens);
    o.batch = pre_batch, o.reps = pre_reps, o.gpu = gpu;
    bench::run_prefill_bench(o);
  });
}

}  // namespace k3::cli
