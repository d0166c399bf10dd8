// `k3 bench kernels`: flags; the harness is bench/harness/kernels.h.
#include <memory>

#include "bench/harness/kernels.h"
#include "cli/commands.h"

namespace k3::cli {

using bench::KernelArgs;
using bench::kKernelSections;
using bench::run_kernels;

void register_bench_kernels(CLI::App* bench) {
  auto* cmd = bench->add_subcommand(
      "kernels", "CUDA kernels against the GPU's measured copy/GEMM ceilings and flash-linear-attention (needs a GPU)");
  auto args = std::make_shared<KernelArgs>();
  cmd->add_option("--reps", args->reps, "Timed repetitions per figure (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--seq-len", args->seq_lens, "Prefill lengths (B = 1)")->capture_default_str();
  cmd->add_option("--heads", args->heads, "Head counts for prefill (K = V = 128)")->capture_default_str();
  cmd->add_option("--decode-batch", args->decode_batches, "Batch sizes of the decode step")->capture_default_str();
  cmd->add_option("--train-batch", args->train_batch, "GPT-2 124M training batch (T = 1024; 0 skips)")
      ->capture_default_str();
  cmd->add_option("--only", args->only, "Run only these sections, comma- or space-separated (the copy/GEMM ceilings always run)")
      ->delimiter(',')
      ->check(CLI::IsMember(kKernelSections));
  cmd->add_option("--cache-dtype", args->cache_dtypes,
                  "Latent caches of the mla section, comma- or space-separated (f32, bf16)")
      ->capture_default_str()
      ->delimiter(',')
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--mla-kernel", args->mla_kernel,
                  "The mla section's kernel for bf16 512 + 64 latents: auto (the warpgroup one), wgmma or mma")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "wgmma", "mma"}));
  cmd->add_option("--versus", args->versus,
                  "JSON of the same shapes timed by fla and PyTorch (tools/gpu/fla_bench.py); a key "
                  "llmc_train_B<batch>_tok_s holds llm.c's training tokens/s timed beside k3 by hand");
  cmd->add_option("--json", args->json, "Write k3's figures as JSON");
  cmd->add_option("--gemm-tuning", args->gemm_tuning,
                  "Time cuBLASLt's candidate algorithms on each GEMM shape's first call and keep the fastest (false: "
                  "its heuristic's first guess)")
      ->capture_default_str();
  cmd->callback([args] { run_kernels(*args); });
}

}  // namespace k3::cli
