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

  // One training step on ids/targets [B, T] (target −1: no loss): forward keeping activations,
  // mean cross-entropy over the scored positions, backward, AdamW with train/optimizer.h's
  // semantics (decoupled decay on ParamKind::Weight only, bias-corrected moments). fp32 weights
  // only. Returns the loss before the update.
  struct Adam {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  };
  float train_step(const int64_t* ids, const int64_t* targets, int64_t B, int64_t T, float lr, const Adam& adam);
  // Mixed precision for train_step: every GEMM's operands rounded to bf16 (forward and backward),
  // attention's too (q, k, v, y, dy: the tensor-core kernels), fp32 accumulation, fp32 softmax,
  // activations, gradients, moments and master weights.
  void set_bf16_gemms(bool on);
  // Copies the GPU weights back into a model of the same configuration.
  void copy_to(const Gpt2Model& model) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::cuda
