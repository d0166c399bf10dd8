// GPT-2's forward on the GPU (gpt2_cuda.cu): the weights of a loaded Gpt2Model uploaded once
// (GEMM weights fp32 or bf16; norms, biases and embeddings fp32), then full forwards (no KV cache)
// of token batches, built from the ops' CUDA kernels: embedding, LayerNorm, cuBLASLt GEMMs,
// flash-style causal attention, GELU, the tied LM head. Activations and the residual stream are
// fp32; with bf16 weights each GEMM's input is cast to bf16 (fp32 accumulation).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "models/gpt2.h"

namespace k3::cuda {

class Gpt2Runner {
 public:
  Gpt2Runner(const Gpt2Model& model, device::Storage weights);
  ~Gpt2Runner();
  Gpt2Runner(const Gpt2Runner&) = delete;
  Gpt2Runner& operator=(const Gpt2Runner&) = delete;

  // ids [B, T] → logits [B, T, vocab] (host, fp32). T ≤ n_positions.
  std::vector<float> logits(const int64_t* ids, int64_t B, int64_t T);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::cuda
