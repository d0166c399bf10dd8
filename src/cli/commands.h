// Each `k3` subcommand lives in its own cmd_*.cc file and registers itself on the app here.
#pragma once

#include <CLI/CLI.hpp>

#include "models/model.h"

namespace k3::cli {

void register_info(CLI::App& app);
void register_logits(CLI::App& app);
void register_generate(CLI::App& app);
void register_op(CLI::App& app);
void register_bench(CLI::App& app);
void register_bench_recall(CLI::App* bench);  // cmd_bench_recall.cc, called from register_bench
void register_bench_memory(CLI::App* bench);  // k3 bench memory (cmd_bench_memory.cc)
void register_bench_kernels(CLI::App* bench);  // k3 bench kernels (cmd_bench_kernels.cc, CUDA)
void register_train(CLI::App& app);
void register_eval(CLI::App& app);
void register_tokenizer(CLI::App& app);
void register_serve(CLI::App& app);  // cmd_serve.cc
void register_quantize(CLI::App& app);  // cmd_quantize.cc

// Options shared by commands that run models.
struct RuntimeOptions {
  int threads = 0;            // 0: all cores
  std::string device = "cpu";  // cpu | cuda
};
void add_runtime_options(CLI::App* cmd, RuntimeOptions& opts);
// --check-weights / --no-check-weights: scan the loaded weights for NaN and Inf (a corrupt checkpoint).
void add_check_weights_option(CLI::App* cmd, bool& check);
// Whether a command has a CUDA path: CpuOnly commands refuse --device cuda with a clear error;
// CpuAndCuda ones check that a usable GPU exists.
enum class DeviceSupport : uint8_t { CpuOnly, CpuAndCuda };
void apply_runtime_options(const RuntimeOptions& opts, DeviceSupport support = DeviceSupport::CpuOnly);

// --cache-dtype (generate, serve, bench decode): the storage of MLA latent caches on CUDA, f32 or
// bf16 (half the bytes; rows rounded to bf16 as they are written). apply checks it against the
// device and sets it for the MLA layers' new memories.
void add_cache_dtype_option(CLI::App* cmd, std::string& dtype);
void apply_cache_dtype(const std::string& dtype, const RuntimeOptions& opts, const char* who);

// --quantize (generate, logits, serve, bench decode and prefill): the linear layers' weights held in
// a block format (fp8, mxfp4; "-experts": the routed experts' only), on either device. With the
// GEMM storage of --dtype (f32, or bf16 on CUDA), the weights' storage for move_to.
void add_quantize_option(CLI::App* cmd, std::string& quantize);
WeightStorage weight_storage(const std::string& dtype, const std::string& quantize, const RuntimeOptions& opts,
                             const char* who);

}  // namespace k3::cli
