// The harness of `k3 bench kernels` (kernels.cc): k3's CUDA kernels timed on this GPU beside the
// measured copy/GEMM ceilings and their anchors. The CLI parses flags into KernelArgs and calls
// run_kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3::bench {

struct KernelArgs {
  int reps = 20;
  std::string versus, json;
  std::vector<int64_t> seq_lens = {8192, 32768};
  std::vector<int64_t> heads = {16};
  std::vector<int64_t> decode_batches = {64, 256};
  int64_t train_batch = 8;
  std::vector<std::string> only;  // sections to run (kKernelSections); empty: all
  std::vector<std::string> cache_dtypes = {"f32", "bf16"};  // the mla section's latent caches
  std::string mla_kernel = "auto";                           // bf16 512 + 64: auto, wgmma or mma
  bool gemm_tuning = true;                                   // cuBLASLt's candidates timed per shape
};

// The sections of the report besides the ceilings, which always run (every ratio needs them).
inline const std::vector<std::string> kKernelSections = {"prefill", "varlen", "decode", "attention",
                                                         "mla",     "small-gemm", "gpt2"};

// Prints the report (and writes --json); a k3::Error without a usable GPU, naming the CPU benchmarks.
void run_kernels(const KernelArgs& args);

}  // namespace k3::bench
