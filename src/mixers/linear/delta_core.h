// The gated delta-rule family as ONE parameterised core (ARCHITECTURE.md, "The memory mechanisms
// are one table"; math in spec §0, §2–5 and README.md beside this file):
//
//   linear attention   Write::Additive  Decay::None        S_t = S_{t-1} + k_t v_tᵀ
//   DeltaNet           Write::Delta     Decay::None        S_t = S_{t-1} + k_t (β_t (v_t − S_{t-1}ᵀk_t))ᵀ
//   Gated DeltaNet     Write::Delta     Decay::Scalar      S ← exp(g_t) S, then the delta write
//   KDA                Write::Delta     Decay::PerChannel  S ← diag(exp(g_t)) S, then the delta write
//   output             o_t = S_tᵀ (scale · q_t)
//
// Three implementations of the same math: a plain recurrent reference (double accumulation,
// forward and backward), the chunked WY/UT form (prefill and training, forward and backward) and
// the single-token step (decode, state updated in place).
//
// Layouts (fla's, spec §5.4): q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head
// hv reads q/k head hv / (HV/H)); beta [B, T, HV]; g [B, T, HV] (Scalar) or [B, T, HV, K]
// (PerChannel), log-space (≤ 0); state [N, HV, K, V] fp32 (K rows, V columns); o [B, T, HV, V].
// N = B, or with cu_seqlens (B must be 1) N = cu_seqlens.size() − 1 packed sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace k3::linear {

enum class Write : uint8_t { Additive, Delta };
enum class Decay : uint8_t { None, Scalar, PerChannel };
// Katharopoulos normaliser o_t = S_tᵀ(s q_t) / (s q_t · z_t + eps), z_t = z_{t-1} + k_t (spec §2).
// Defined for Write::Additive only.
enum class Normalize : uint8_t { Off, On };
enum class Impl : uint8_t { Recurrent, Chunked };

struct DeltaOptions {
  Write write = Write::Delta;
  Decay decay = Decay::None;
  float scale = 0.0f;  // query scale; 0 means fla's default K^-1/2 (spec §0)
  int chunk = 64;      // chunk length of the chunked form (16, 32, 64 or 128 are the usual ones)
  Normalize normalize = Normalize::Off;
  float eps = 1e-10f;  // normaliser epsilon (fla's chunk_linear_attn)
  // Where to run. On CUDA `Impl` picks the recurrent (delta_cuda.cu) or chunked
  // (delta_chunked_cuda.cu, 64-token chunks whatever `chunk` says) kernels. q/k/v/o are stored
  // as `io_dtype` there (F32 or BF16; β, g and the state stay fp32).
  Device device = Device::CPU;
  DType io_dtype = DType::F32;
};

struct DeltaInputs {
  Tensor q, k;   // [B, T, H, K]
  Tensor v;      // [B, T, HV, V]
  Tensor beta;   // [B, T, HV]              Write::Delta only
  Tensor g;      // [B, T, HV] or [B, T, HV, K]   Decay::Scalar / Decay::PerChannel only
  Tensor h0;     // [N, HV, K, V] initial state; undefined means zeros
  Tensor z0;     // [N, HV, K] initial normaliser sum; Normalize::On only, undefined means zeros
  std::vector<int64_t> cu_seqlens;  // packed sequences: offsets 0 = c_0 < ... < c_N = T, B == 1
};

struct DeltaOutputs {
  Tensor o;   // [B, T, HV, V]
  Tensor ht;  // [N, HV, K, V]
  Tensor zt;  // [N, HV, K], Normalize::On only
};

// Cotangents of the outputs; any may be undefined (zero).
struct DeltaCotangents {
  Tensor d_o;  // [B, T, HV, V]
  Tensor dht;  // [N, HV, K, V]
  Tensor dzt;  // [N, HV, K]
};

// Gradients of Σ o·d_o + Σ ht·dht (+ Σ zt·dzt) with respect to every input that the options use;
// the others stay undefined.
struct DeltaGrads {
  Tensor dq, dk, dv, dbeta, dg, dh0, dz0;
};

DeltaOutputs delta_forward(const DeltaInputs& in, const DeltaOptions& opts, Impl impl);
// Recomputes what it needs from the inputs (no saved activations).
DeltaGrads delta_backward(const DeltaInputs& in, const DeltaCotangents& cot, const DeltaOptions& opts, Impl impl);

// Decode state of N sequences.
struct DeltaState {
  Tensor S;  // [N, HV, K, V]
  Tensor z;  // [N, HV, K], Normalize::On only
  // Or, with S undefined, each sequence's state where it lives (a decode batch's own memories):
  // S_seq[n] → [HV, K, V] and (Normalize::On) z_seq[n] → [HV, K], fp32, N entries each.
  std::vector<float*> S_seq, z_seq;
};
// One token per sequence: in.q/k are [N, 1, H, K], v [N, 1, HV, V], beta [N, 1, HV], g [N, 1, HV]
// or [N, 1, HV, K]; in.h0/z0/cu_seqlens are ignored. Updates `state` in place (the tensors, or the
// per-sequence states without a copy); returns o [N, 1, HV, V].
Tensor delta_step(const DeltaInputs& in, DeltaState& state, const DeltaOptions& opts);

}  // namespace k3::linear
