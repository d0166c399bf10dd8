// k3: the command-line entry point. Errors surface here: k3::Error (user-facing) and anything
// else are printed to stderr with a non-zero exit code.
#include <malloc.h>
#include <unistd.h>

#include <cstdlib>

#include <iostream>

#include "cli/commands.h"
#include "core/device.h"
#include "core/error.h"
#include "core/parallel.h"
#if defined(K3_HAS_CUDA)
#include "mixers/mla/mla.h"
#endif

namespace k3::cli {

void add_runtime_options(CLI::App* cmd, RuntimeOptions& opts) {
  cmd->add_option("--threads", opts.threads, "CPU threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--device", opts.device, "Where to run: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
}

void add_check_weights_option(CLI::App* cmd, bool& check) {
  cmd->add_flag("--check-weights,!--no-check-weights", check,
                "Refuse weights holding NaN or Inf values (a scan of every tensor at load)")
      ->capture_default_str();
}

void apply_runtime_options(const RuntimeOptions& opts, DeviceSupport support) {
  if (opts.device == "cuda") {
    if (support == DeviceSupport::CpuOnly)
      throw error("cli", "--device cuda: this command runs on the CPU only so far (the CUDA backend covers "
                         "`k3 logits`, `generate`, `eval`, `serve`, `op run`, `bench decode` and `bench kernels`); "
                         "use --device cpu");
    device::require_cuda("cli");
  }
  set_num_threads(opts.threads);
}

void add_cache_dtype_option(CLI::App* cmd, std::string& dtype) {
  cmd->add_option("--cache-dtype", dtype,
                  "MLA latent cache storage on CUDA: f32, or bf16 (half the bytes and faster decode; the cached rows "
                  "are rounded to bf16). Models without MLA layers keep their caches as they are")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
}

void apply_cache_dtype(const std::string& dtype, const RuntimeOptions& opts, const char* who) {
  if (dtype == "bf16" && opts.device != "cuda")
    throw error(who, "--cache-dtype bf16 applies to --device cuda (the CPU caches are fp32)");
  set_latent_storage(dtype == "bf16" ? DType::BF16 : DType::F32);
}

void add_quantize_option(CLI::App* cmd, std::string& quantize) {
  cmd->add_option("--quantize", quantize,
                  "Hold the linear layers' weights in a block format and multiply them packed: fp8 (E4M3, one scale "
                  "per 128 x 128 tile), mxfp4 (E2M1, one power-of-two scale per 32), or fp8-experts / mxfp4-experts "
                  "for the routed experts only. A checkpoint's own FP8 or MXFP4 weights stay packed either way")
      ->check(CLI::IsMember({"none", "fp8", "mxfp4", "fp8-experts", "mxfp4-experts"}))
      ->capture_default_str();
}

WeightStorage weight_storage(const std::string& dtype, const std::string& quantize, const RuntimeOptions& opts,
                             const char* who) {
  WeightStorage s;
  if (dtype == "bf16") {
    if (opts.device != "cuda") throw error(who, "--dtype bf16 applies to --device cuda");
    s.gemm = DType::BF16;
  }
  if (quantize != "none" && !parse_quantize(quantize, &s)) throw error(who, "--quantize ", quantize, " is not a format");
  return s;
}

}  // namespace k3::cli

namespace {
// Debian's OpenBLAS 0.3.21 does not recognise some virtualised Xeons ("Intel Xeon Processor")
// and falls back to its SSE3 "Prescott" kernels, 2-4x slower than the AVX2/AVX-512 ones the CPU
// supports. OpenBLAS reads OPENBLAS_CORETYPE when it is loaded, before main, so k3 sets it and
// re-executes itself once. An explicit OPENBLAS_CORETYPE is always respected.
void choose_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv("K3_BLAS_REEXEC")) return;
  const char* core = nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    core = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    core = "Haswell";
  if (!core) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  setenv("K3_BLAS_REEXEC", "1", 1);
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  execv(self, argv);  // on failure, carry on with the default kernels
}
}  // namespace

int main(int argc, char** argv) {
  choose_blas_kernels(argv);
  // Activations are large, short-lived buffers: keep freed memory in the heap instead of
  // returning it to the kernel (mmap/munmap + page faults on every op otherwise).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"k3: load, run, train and measure the GPT-2 -> linear attention -> DeltaNet -> "
               "Gated DeltaNet -> KDA -> Kimi K3 family of language models.",
               "k3"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  k3::cli::register_info(app);
  k3::cli::register_logits(app);
  k3::cli::register_generate(app);
  k3::cli::register_op(app);
  k3::cli::register_bench(app);
  k3::cli::register_train(app);
  k3::cli::register_eval(app);
  k3::cli::register_tokenizer(app);
  k3::cli::register_serve(app);
  k3::cli::register_quantize(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const k3::Error& e) {
    std::cerr << "k3: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "k3: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
