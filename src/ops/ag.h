// Differentiable ops on Vars (autograd.h): each forward records a backward beside it. Values are
// contiguous fp32; "rows" means all leading dimensions flattened, the last one is the feature.
#pragma once

#include <optional>
#include <vector>

#include "ops/autograd.h"
#include "ops/gemm.h"

namespace k3::ag {

// y[M, out] = x[M, in] W (+ b). w holds [out, in] (OutIn) or [in, out] (InOut).
Var linear(const Var& x, const Var& w, const Var& b, WeightLayout layout);
Var add(const Var& a, const Var& b);                 // same shape
Var sub(const Var& a, const Var& b);                 // same shape
Var mul(const Var& a, const Var& b);                 // same shape, elementwise
Var scale(const Var& a, float s);
Var sigmoid(const Var& a);
Var silu(const Var& a);
Var gelu_tanh(const Var& a);
Var elu1(const Var& a);  // linear attention's feature map φ(x) = elu(x) + 1 (spec §2)
Var layernorm(const Var& x, const Var& w, const Var& b, float eps);
Var rmsnorm(const Var& x, const Var& w, float eps);  // w may be null
// [n, D]. Rows of padding_idx get no gradient (PyTorch's nn.Embedding(padding_idx=...), which
// HF DeepSeek/Kimi models use: their pad row never trains).
Var embedding(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx = std::nullopt);
// The same lookup by positions (learned position embeddings): a decode step replayed as a CUDA
// graph (device::Graph) advances them, where it feeds new token ids to embedding().
Var position_embedding(const Var& table, const std::vector<int64_t>& positions);
Var reshape(const Var& x, Shape shape);
Var slice_last(const Var& x, int64_t begin, int64_t end);  // along the last dim
Var concat_last(const std::vector<Var>& xs);
// Causal softmax attention of B sequences of T tokens. q, k, v: [B*T, H*hd] (head h in columns
// [h*hd, (h+1)*hd)); returns [B*T, H*hd]. Backward recomputes the probabilities (no T² saved).
Var causal_attention(const Var& q, const Var& k, const Var& v, int64_t B, int64_t T, int64_t H, float scale);
// Mean cross-entropy of logits = h Wᵀ against targets (rows with target < 0 are ignored),
// computed in vocabulary chunks: no [N, V] buffer is ever formed. h [N, D], w [V, D].
// z_loss > 0 adds z_loss · mean(logsumexp²) (PaLM's z-loss, keeps the softmax normaliser near 1).
Var cross_entropy_head(const Var& h, const Var& w, const std::vector<int64_t>& targets, int64_t vocab_chunk = 4096,
                       float z_loss = 0.0f);
Var sum(const Var& a);  // scalar [1]

}  // namespace k3::ag
