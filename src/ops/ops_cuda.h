// CUDA kernels of the stateless ops (ops/*_cuda.cu), on device pointers, queued on k3's stream
// (core/device.h), one section per kernel file with each op's forward and backward together. Each
// mirrors the CPU function of the same name without the suffix and is tested against it
// (ops_cuda_test.cc, ag_cuda_test.cc). `Storage` says how activations are stored on the device
// (fp32 or bf16); arithmetic, statistics and gradients of parameters are fp32. Arrays are
// row-major [rows, columns] unless said otherwise; backwards accumulate (+=) into their gradients
// (null ones are skipped) unless said otherwise.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "ops/gates.h"

namespace k3::cuda {

using device::Storage;

// ---- gates_cuda.cu

// KDA gates (ops/gates.h): x, g [rows, H, K] fp32; A_log [H]; dt_bias [H·K]. Backward
// accumulates (+=) into dx, dA_log, ddt_bias (any may be null).
void gate_softplus_forward(const float* x, const float* A_log, const float* dt_bias, float* g, GateShape s);
void gate_softplus_backward(const float* x, const float* A_log, const float* dt_bias, const float* dg, float* dx,
                            float* dA_log, float* ddt_bias, GateShape s);
void gate_lowerbound_forward(const float* x, const float* A_log, const float* dt_bias, float lower_bound, float* g,
                             GateShape s);
void gate_lowerbound_backward(const float* x, const float* A_log, const float* dt_bias, float lower_bound,
                              const float* dg, float* dx, float* dA_log, float* ddt_bias, GateShape s);

// ---- norm_cuda.cu

// Norms over the last dimension of x [M, D] (ops/norm.h). mean/rstd [M] are written when non-null.
// Backward: dx = (the layer norm's += with accumulate), dw/db accumulate.
void layernorm_forward(const void* x, const float* w, const float* b, float eps, int64_t M, int64_t D, void* y,
                       float* mean, float* rstd, Storage st);
// The same over fp32 rows with y stored as y_st (a bf16 GEMM operand written by the norm itself).
void layernorm_forward_to(const float* x, const float* w, const float* b, float eps, int64_t M, int64_t D, void* y,
                          Storage y_st, float* mean, float* rstd);
// accumulate: dx += instead of = (a residual stream's adjoint takes the norm's gradient in place).
void layernorm_backward(const void* x, const float* w, const float* mean, const float* rstd, const void* dy,
                        int64_t M, int64_t D, void* dx, float* dw, float* db, Storage st, bool accumulate = false);
// The backward over fp32 rows into a residual stream's adjoint, with what the GEMMs that read
// that adjoint next want from the same pass: dx (= or +=), its bf16 copy (dx_bf16, may be null) and
// its column sums (dsum += Σ_m dx[m, :], may be null: the bias gradient of a GEMM whose output
// gradient dx is). dy is stored as dy_st (fp32, or bf16 as a bf16 GEMM writes it). One kernel
// where D % 4 == 0, D ≤ 1,024 and the arrays are aligned, else the composed ops.
void layernorm_backward_residual(const float* x, const float* w, const float* mean, const float* rstd, const void* dy,
                                 Storage dy_st, int64_t M, int64_t D, float* dx, void* dx_bf16, float* dw, float* db,
                                 float* dsum, bool accumulate);
void rmsnorm_forward(const void* x, const float* w, float eps, int64_t M, int64_t D, void* y, float* rstd,
                     Storage st);
void rmsnorm_backward(const void* x, const float* w, const float* rstd, const void* dy, int64_t M, int64_t D,
                      void* dx, float* dw, Storage st);

// ---- ag_norms_cuda.cu

// Over G groups of d values: y = x / sqrt(Σx² + eps) (ops/ag_norms.h's l2norm), and the gated
// RMSNorm y = x·rstd·w[j]·act(gate), act 0 none, 1 sigmoid, 2 swish (w may be null).
void l2norm_groups(const float* x, float* y, int64_t G, int64_t d, float eps);
void gated_rmsnorm_groups(const float* x, const float* gate, const float* w, float* y, int64_t G, int64_t d, float eps,
                          int act);

void l2norm_groups_backward(const float* x, const float* dy, float* dx, int64_t G, int64_t d, float eps);
void gated_rmsnorm_groups_backward(const float* x, const float* gate, const float* w, const float* dy, float* dx,
                                   float* dgate, float* dw, int64_t G, int64_t d, float eps, int act);

// ---- activation_cuda.cu

// Elementwise activations (ops/activation.h, ops/situ.h). Backward overwrites dx (dgate, dup).
void gelu_tanh_forward(const void* x, void* y, int64_t n, Storage st);
// dx_bf16 (fp32 storage only; may be null) receives a bf16 copy of dx, a GEMM's operand.
void gelu_tanh_backward(const void* x, const void* dy, void* dx, int64_t n, Storage st, void* dx_bf16 = nullptr);
// The same over fp32 [M, N] rows with the bias gradient in the one pass: dx = dy ∘ GELU'(x)
// written as fp32 (dx) and/or as its bf16 copy (dx_bf16), either may be null, and
// dbias[N] += Σ_m dx[m, :] (the bias that fed x). One kernel where N % 4 == 0 and the arrays are
// aligned, else the composed ops.
void gelu_tanh_backward_bias(const float* x, const float* dy, int64_t M, int64_t N, float* dx, void* dx_bf16,
                             float* dbias);
// The same with x and dy stored as bf16 (a bf16 GEMM's pre-activation and output gradient) and dx
// written only as bf16.
void gelu_tanh_backward_bias_bf16(const void* x, const void* dy, int64_t M, int64_t N, void* dx_bf16, float* dbias);
// x [M, N] += bias [N] in place (null: none), then y = GELU(x) stored as st: a linear layer's bias
// and activation in one pass, the pre-activation kept in x for the backward.
void bias_gelu_tanh_to(float* x, const float* bias, void* y, int64_t M, int64_t N, Storage st);
// y = situ_gate(gate) · situ_up(up); beta / beta_lin ≤ 0 mean "absent" (plain SiLU / plain up).
void situ_glu_forward(const void* gate, const void* up, void* y, int64_t n, float beta, float beta_lin, Storage st);
void situ_glu_backward(const void* gate, const void* up, const void* dy, void* dgate, void* dup, int64_t n,
                       float beta, float beta_lin, Storage st);

// ---- elementwise_cuda.cu

enum class Unary : uint8_t { Scale, Sigmoid, Silu, Elu1 };  // s·x, σ(x), x·σ(x), elu(x) + 1
void unary(const float* x, float* y, int64_t n, Unary op, float s = 1.0f);
enum class Binary : uint8_t { Add, Mul };
void binary(const float* a, const float* b, float* y, int64_t n, Binary op);
void unary_backward(const float* x, const float* dy, float* dx, int64_t n, Unary op, float s = 1.0f);
void mul_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n);
// Small glue kernels: y += x (n values); y[M, N] += bias[N]; fp32 → bf16/fp32 copy (casts
// activations to a GEMM's operand storage) and back; the q/k/v column blocks of a fused [M, 3·H·hd]
// projection into three contiguous [M, H, hd] arrays.
void add_inplace(float* y, const float* x, int64_t n);
void add_bias(float* y, const float* bias, int64_t M, int64_t N);
void cast(const float* x, void* y, int64_t n, Storage st);
void widen(const void* x, float* y, int64_t n, Storage st);  // cast's inverse: storage `st` → fp32
// split_qkv_to adds the projection's bias [3D] (null: none) and stores q, k, v as st.
void split_qkv_to(const float* qkv, const float* bias, void* q, void* k, void* v, int64_t M, int64_t D, Storage st);
// The same from a bf16 [M, 3D] (a bf16 GEMM's output, its bias added by the GEMM) into bf16 arrays.
void split_qkv_bf16(const void* qkv, void* q, void* k, void* v, int64_t M, int64_t D);
// Its inverse (fp32); qkv_bf16 (may be null) receives a bf16 copy of qkv.
void merge_qkv(const float* q, const float* k, const float* v, float* qkv, int64_t M, int64_t D,
               void* qkv_bf16 = nullptr);
// The merge with the projection's bias gradient in the one pass: qkv (fp32) and/or qkv_bf16, either
// may be null, and dbias[3D] += Σ_m qkv[m, :] (dbias null: no sums). One kernel where D % 4 == 0
// and the arrays are aligned, else the composed ops.
void merge_qkv_bias(const float* q, const float* k, const float* v, int64_t M, int64_t D, float* qkv, void* qkv_bf16,
                    float* dbias);
void bias_grad(const float* dy, float* db, int64_t M, int64_t N);  // db[N] += Σ_m dy[m, :]
// dbias[N] += Σ_m x[m, :] over rows ldx elements apart, x stored as st.
void column_sums(const void* x, int64_t M, int64_t N, int64_t ldx, Storage st, float* dbias);
// y (bf16, rows ldy elements apart) = x [M, N] (fp32), and dbias[N] += Σ_m x[m, :] when non-null.
void to_bf16_with_column_sums(const float* x, int64_t M, int64_t N, void* y, int64_t ldy, float* dbias);

// *acc += Σ x² (acc: one double on the device; gradient clipping reads it back once per step).
void sum_squares(const float* x, int64_t n, double* acc);

// ---- blocks_cuda.cu

// dst[m·d_row + h·d_head + j] = src[m·s_row + h·s_head + j] for m < M, h < H, j < w: column
// slices, per-head slices and concatenations, broadcasts (s_head = 0).
void copy_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                 int64_t H, int64_t w);
// copy_blocks' layout with dst += src (the backward of slices, concatenations and head layouts).
void add_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                int64_t H, int64_t w);

// ---- ag_moe_cuda.cu

// y[i] = x[rows[i]] (rows on the device).
void gather_rows(const float* x, const int64_t* rows, int64_t n, int64_t D, float* y);
// out[rows[p]] += w[slots[p]] · ys[p] for p < n (ys [n, D]), atomically.
void scatter_weighted(const float* ys, const int64_t* rows, const int64_t* slots, const float* w, int64_t n, int64_t D,
                      float* out);
// y[m, k] = s[m, idx[m·K + k]] (+ offset[idx], when non-null).
void gather_cols(const float* s, const int64_t* idx, const float* offset, int64_t M, int64_t E, int64_t K, float* y);
void softmax_rows(const float* x, float* y, int64_t M, int64_t N);
// idx[m] = the first column of row m of x [M, N] holding the row's largest value (NaNs never win;
// a row of NaNs gives 0): greedy decoding on the device, as std::max_element / torch.argmax.
void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* idx);
void normalize_sum_rows(const float* x, float* y, int64_t M, int64_t N, float eps);  // y = x / (Σ x + eps)
void scatter_add_rows(const float* dy, const int64_t* rows, int64_t n, int64_t D, float* dx);  // dx[rows[i]] += dy[i]
void scatter_cols_add(const float* dy, const int64_t* idx, int64_t M, int64_t E, int64_t K, float* ds);
void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t M, int64_t N);
void normalize_sum_rows_backward(const float* x, const float* y, const float* dy, float* dx, int64_t M, int64_t N,
                                 float eps);
void scatter_weighted_backward(const float* dout, const float* ys, const int64_t* rows, const int64_t* slots,
                               const float* w, int64_t n, int64_t D, float* dys, float* dw);

// ---- ag_conv_cuda.cu

// Causal depthwise convolution (ops/ag_conv.h) of B sequences of T rows, zero left padding.
void short_conv(const float* x, const float* w, int64_t B, int64_t T, int64_t C, int64_t W, float* y);
void short_conv_backward(const float* x, const float* w, const float* dy, int64_t B, int64_t T, int64_t C, int64_t W,
                         float* dx, float* dw);

// ---- embedding_cuda.cu

// Embedding rows: y[n, D] = table[ids[n]] (fp32 table); backward atomically adds dy into dtable.
// check_ids: an id outside [0, vocab) throws (the check waits for the kernel); callers that
// validated the ids on the host pass false and stay asynchronous.
void embedding_forward(const float* table, int64_t vocab, const int64_t* ids, int64_t n, int64_t D, void* y,
                       Storage st, bool check_ids = true);
// Rows with a negative id (padding) add nothing.
void embedding_backward(const int64_t* ids, int64_t n, int64_t D, const void* dy, float* dtable, Storage st);

// ---- rope_cuda.cu

// RoPE on rows x [M, H, hd] in place, adjacent pairs (ops/rope.h): columns [offset, offset + rot)
// of each head at row m rotate by positions[m]·inv_freq[i] (inv_freq [rot/2] fp32, scaled cos/sin
// by attn_factor; angles in double as on the CPU). direction −1 is the inverse rotation.
// half_pairs: column i pairs with i + rot/2 (rotate-half) instead of 2i with 2i + 1.
void rope_apply(void* x, int64_t M, int64_t H, int64_t hd, int64_t offset, int64_t rot, const int64_t* positions,
                const double* inv_freq, double attn_factor, int direction, Storage st, bool half_pairs = false);

// ---- attention_cuda.cu, attention_mma_cuda.cu

// Causal softmax attention, flash-style (no [T, S] matrix in memory): B sequences, H heads;
// q [B, Tq, H, hd], k [B, S, H, hd], v [B, S, H, hdv], y [B, Tq, H, hdv] contiguous, all of
// storage `st`; query i of every sequence sees keys 0 .. pos0 + i (S ≥ pos0 + Tq: a prefill has
// pos0 = 0, a decode step over a KV cache Tq = 1, pos0 = S − 1). lse [B, H, Tq] (fp32, natural
// log of each row's softmax denominator) is written when non-null, for the backward pass.
// hd, hdv ≤ 256.
struct AttnShape {
  int64_t B, Tq, S, H, hd, hdv, pos0;
  float scale;
};
void attention_forward(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a,
                       Storage st);
// The same over per-sequence caches, all sequences in one launch (a decode step over KV caches,
// replayable in a CUDA graph): B sequences of Tq new queries each, query row b·Tq + t, head h at
// q + row·ldq + h·hd; sequence b's keys and values are the rows of ks[b] ([rows, H·hd]) and vs[b]
// ([rows, H·hdv]); query t sees keys 0 .. p0s[b] + t. ks, vs and p0s are device arrays of B
// entries. longest ≥ every p0s[b] + Tq sizes the split over the keys:
// a graph captured for the caches' capacity replays for every shorter length. y [B·Tq, H, hdv].
// group > 1: grouped-query attention, the caches holding H / group heads, head h reading h / group.
void attention_cached(const void* q, int64_t ldq, const void* const* ks, const void* const* vs, const int64_t* p0s,
                      int64_t longest, void* y, int64_t B, int64_t Tq, int64_t H, int64_t hd, int64_t hdv, float scale,
                      Storage st, int64_t group = 1);
// Gradients (fp32, accumulated: zero them first) from the forward's y and lse: recomputes the
// probabilities tile by tile (FlashAttention-2's backward). With accumulate_kv false, dk and dv are
// written (=) rather than added to, so only dq needs zeroing (the tensor-core kernel then neither
// reads them nor needs them cleared).
void attention_backward(const void* q, const void* k, const void* v, const void* y, const float* lse,
                        const void* dy, float* dq, float* dk, float* dv, const AttnShape& a, Storage st,
                        bool accumulate_kv = true);
// The same over q, k and v packed as the column blocks of one bf16 [B·T, 3·H·hd] array (a fused
// projection's output, read in place: no split) for a prefill (Tq = S, pos0 = 0, hd = hdv); y is
// a contiguous bf16 [B, T, H, hd] as attention_forward's. The backward writes the gradient in the
// same packed bf16 layout, dqkv [B·T, 3·H·hd] (written over), and adds its column sums into dbias
// [3·H·hd] when non-null: the fused projection's bias gradient. Tensor cores at hd 64 and 128;
// other head dims split, run the general kernels and merge.
void attention_forward_qkv(const void* qkv, void* y, float* lse, const AttnShape& a);
void attention_backward_qkv(const void* qkv, const void* y, const float* lse, const void* dy, void* dqkv,
                            float* dbias, const AttnShape& a);

// ---- cross_entropy_cuda.cu

// Softmax cross-entropy over logits [M, Vocab] (fp32) against targets [M] (−1 = ignored), with
// the z-loss c·lse² (c = z_loss): loss[M] per row, and dlogits [M, Vocab] = (softmax·(1 + 2c·lse)
// − onehot) · scale (null: no gradient; may be `logits` itself, overwritten in place). Rows of
// both are `ld` floats apart (0: vocab), as when the head's weight has padded rows: dlogits'
// columns [vocab, ld) are written as zeros.
void cross_entropy(const float* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                   float* dlogits, float scale, float z_loss = 0.0f, int64_t ld = 0);
// The same with dlogits (a separate array, or null) stored as st: a bf16 GEMM operand written by
// the loss itself.
void cross_entropy_to(const float* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                      void* dlogits, Storage st, float scale, float z_loss = 0.0f, int64_t ld = 0);

// The same over bf16 logits (a bf16 GEMM's output), dlogits bf16 too (may be `logits` itself).
void cross_entropy_bf16(const void* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                        void* dlogits, float scale, float z_loss = 0.0f, int64_t ld = 0);

// ---- optim_cuda.cu

// AdamW step on fp32 parameters (train/optimizer.h semantics: decoupled weight decay,
// bias-corrected moments).
struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};
void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s);
// The same step over many tensors in one launch, each with its own weight decay: a model's
// parameters, whose arrays must outlive the group. The tensors' table and their chunks of 4,096
// values are uploaded once, at construction.
// param_bf16, when set, receives the updated parameters rounded to bf16 (the copy bf16 GEMMs
// read, made in the step's own pass instead of a cast of its own).
struct AdamWTensor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  int64_t n;
  float weight_decay;
  void* param_bf16 = nullptr;
};
class AdamWGroup {
 public:
  explicit AdamWGroup(const std::vector<AdamWTensor>& tensors);
  void step(const AdamWStep& s) const;  // s.weight_decay is not used: each tensor's own applies
 private:
  device::Buffer tensors_, chunks_;
  int64_t chunks_count_ = 0;
};

// ---- linear_blocks_cuda.cu

// Products with a block-format weight W [out, in] (core/quant.h: its codes, then its scales, at w):
// y[M, out] = beta·y + x[M, in] · Wᵀ (+ bias) for 1 ≤ M ≤ kGemvMaxRows, reading W once, packed;
// and W's values as bf16 [out, in] at out (for a tensor-core GEMM of a larger batch).
inline constexpr int64_t kGemvMaxRows = 8;
void gemv_blocks(DType fmt, const float* x, int64_t M, const void* w, int64_t in, int64_t out, const float* bias,
                 float* y, float beta);
void dequantize_to_bf16(DType fmt, const void* w, int64_t n, void* out);

// ---- gemm_cuda.cu

// C[M, N] = alpha · op(A) op(B) + beta · C (+ bias), row-major, through cuBLASLt. A and B stored
// as `st` (bf16 operands accumulate in fp32); C is fp32. bias, when given, is an fp32 [N] vector
// added to every row by cuBLASLt's epilogue (no pass over C of its own).
enum class Op : uint8_t { N, T };
void gemm(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
          int64_t ldb, float beta, float* C, int64_t ldc, Storage st, const float* bias = nullptr);
// The same with the output described apart: D stored as `st` (bf16 needs bf16 operands: the
// product is rounded once, after fp32 accumulation and the bias; cuBLASLt's epilogue then reads
// the bias rounded to bf16, cast by the call), and beta's addend read from `c`
// (same layout and storage as D) when given, else from D itself: x_next = x + y W + b without
// overwriting x.
//
// Epilogues for an MLP's GELU (its tanh form), run by cuBLASLt where it has them:
// - Gelu: D = GELU(op(A) op(B) + bias), and `aux` [M, N] (contiguous, stored as D) receives the
//   pre-activation op(A) op(B) + bias the backward needs. D must be bf16, ldc = N.
// - GeluGrad: D = op(A) op(B) ∘ GELU'(aux), aux the forward's pre-activation: the gradient through
//   the GELU, from the gradient of its output. D must be bf16, ldc = N.
// Where cuBLASLt has no algorithm for an epilogue (or N % 8 ≠ 0, or D or aux is not 16-byte
// aligned) the same results come from the plain GEMM and the elementwise kernels.
enum class Epilogue : uint8_t { None, Gelu, GeluGrad };
struct GemmOut {
  void* d;
  Storage st = Storage::F32;
  const void* c = nullptr;
  const float* bias = nullptr;
  Epilogue epi = Epilogue::None;
  void* aux = nullptr;
};
void gemm_out(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
              int64_t ldb, float beta, const GemmOut& out, int64_t ldc, Storage st);
// GEMM tuning: a new shape's first call times up to 8 of cuBLASLt's candidate algorithms (on
// scratch outputs; not while a graph is being captured) and keeps the fastest for the shape,
// where otherwise the heuristic's first guess is taken. The choice can differ between runs, and
// with it the order of the sums. The library starts with K3_GEMM_TUNE (1: on; default off);
// `k3 train` and `k3 bench kernels` set it from their --gemm-tuning (default on), and a shape
// keeps the algorithm chosen at its first call.
void set_gemm_tuning(bool on);
bool gemm_tuning();

// Many GEMMs in one launch: for each problem i, row-major C_i[M_i, N] = A_i[M_i, K] · B_iᵀ with
// B_i [N, K] (a Linear's [out, in] weight), contiguous rows; A and B stored as `st`, C fp32. One
// k3 kernel for the decode step's small M (≤ 256 rows per problem): bf16 on the tensor cores
// (exact products), fp32 as fp32 FMAs; larger problems take one gemm() each. Problems with
// M_i = 0 are skipped.
// A problem's N, when set (> 0), replaces the call's: one call can then project one input through
// weights of different widths.
struct GemmProblem {
  int64_t M;
  const void* A;
  const void* B;
  float* C;
  int64_t N = 0;
};
void gemm_nt_grouped(int64_t N, int64_t K, const std::vector<GemmProblem>& problems, Storage st);

// `count` fp32 GEMMs of one shape in one call (exact fp32 products): problem i is gemm() on
// A + i·sa, B + i·sb, C + i·sc (strides in floats, row-major, leading dimensions as in gemm()).
void gemm_strided(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, int64_t sa,
                  const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc, int64_t sc,
                  int64_t count);

}  // namespace k3::cuda
