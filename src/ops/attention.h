// Causal softmax attention for one sequence (the GPT-2 mixer's math; spec §1).
#pragma once

#include <cstdint>

namespace k3 {

// A [T, H, hd] view with arbitrary token and head strides (in elements): element (t, h, i) is
// base[t * token_stride + (h / group) * head_stride + i]. Lets q/k/v be read straight out of a
// fused qkv buffer or a token-major KV cache without copies; group > 1 shares each stored head
// among that many consecutive heads (grouped-query attention's keys and values).
struct HeadView {
  float* base;
  int64_t token_stride;
  int64_t head_stride;
  int64_t group = 1;
  float* at(int64_t t, int64_t h) const { return base + t * token_stride + (h / group) * head_stride; }
};

struct AttentionShape {
  int64_t Tq;     // query tokens
  int64_t S;      // key/value tokens available (S >= pos0 + Tq)
  int64_t H;      // heads
  int64_t hd;     // query/key head dim
  int64_t pos0;   // absolute position of the first query: query i sees keys 0..pos0+i
  float scale;    // usually 1/sqrt(hd)
  int64_t hdv = 0;  // value head dim (0: same as hd; MLA uses 192 for q/k and 128 for v)
  int64_t vd() const { return hdv ? hdv : hd; }
};

// y[t, h, :] = Σ_s softmax_s(scale q·k_s) v_s over the causal window. probs, if given, receives
// the [H, Tq, S] attention probabilities (for the backward pass).
void attention_forward(const HeadView& q, const HeadView& k, const HeadView& v, const HeadView& y,
                       const AttentionShape& shape, float* probs = nullptr);

// Backward given the saved probabilities: dq, dk, dv accumulate.
void attention_backward(const HeadView& q, const HeadView& k, const HeadView& v, const float* probs,
                        const HeadView& dy, const HeadView& dq, const HeadView& dk, const HeadView& dv,
                        const AttentionShape& shape);

}  // namespace k3
