// The chunked CUDA kernels of the delta-rule family share this header: the per-call parameter
// block (ChunkDev), the constants that fix the chunk and the blocks' shapes, scratch indexing,
// and the device helpers more than one stage uses (the gates' cumulative sums, cp.async tile
// copies, TF32 fragment addressing). The stages are one file each, around it:
//   delta_chunked_prepare_cuda.cu  prepare: grams, T = (I + diag(β) Ā)⁻¹, W, U, Qg, Kd, Aqk
//   delta_chunked_states_cuda.cu   the chunk-state chain: recur (forward) and reverse (its adjoint)
//   delta_chunked_output_cuda.cu   output: O = Qg S₀ + Aqk V_new
//   delta_chunked_grads_cuda.cu    grads: the rest of a chunk's backward
//   delta_chunked_cuda.cu          the host side: scratch, windows, the order of the launches
// The math and the kernels' design: delta_chunked_cuda.cu's opening comment and README.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_util.cuh"
#include "core/device.h"
#include "core/dtype.h"
#include "mixers/linear/delta_cuda.h"

namespace k3::linear::detail {

using device::axpy4;
using device::cp_async16;
using device::cp_async_commit;
using device::cp_async_wait0;
using device::cp_async_wait1;
using device::from_f32;
using device::to_f32;

constexpr int kC = 64;           // chunk length
constexpr int kPrepThreads = 256;
constexpr int kVb = 16;          // value columns per recurrence block: 16 blocks per head at V 128 (SMs stay busy)
constexpr int kRecWarps = 8, kRecThreads = kRecWarps * 32;
// In the per-tile kernels thread t owns column t % kVb ("lane") of row group t / kVb ("warp").
constexpr int kGroups = kRecThreads / kVb;
constexpr int kRowsPerWarp = kC / kGroups;  // chunk rows per row group
constexpr double kLog2e = 1.4426950408889634;
constexpr int64_t kScratchBudget = int64_t(1) << 30;  // bytes of scratch per window

struct ChunkDev {
  int N, H, HV, K, V, group;
  int delta_write, decay;  // decay: 0 none, 1 scalar, 2 per-channel
  float scale;
  const int64_t* row0;
  const int64_t* len;
  const void *q, *k, *v;
  const float *beta, *g;
  void* o;
  int o_f32;
  const float* s_in;  // [N, HV, K, V] state entering the window, or null (zeros)
  float* s_out;       // [N, HV, K, V] state after the window
  int c_begin, c_count;  // the window: chunks [c_begin, c_begin + c_count) of every sequence
  int KS;                // K rounded up to 4 (row stride of the K-wide scratch)
  // Scratch, per (sequence, value head): c_count·kC rows.
  float *W, *U, *Qg, *Kd, *Aqk, *gC;
  float* TA;     // [NHV, c_count·kC, kC] T (lower, unit diagonal) and Ā transposed above it, or null
  float* Sc;     // [NHV, c_count, K, V] state entering each chunk, or null (forward only)
  int store_vn;  // recur writes V_new over U (the backward reads it)
  int tc;        // prepare / recur / output / reverse on the tensor cores (TF32): bf16 storage, K % 16 == 0
  // Backward.
  const void* d_o;  // io dtype (or fp32 when do_f32), or null
  int do_f32;
  const float* ds_in;  // [N, HV, K, V] adjoint of the state leaving the window, or null (zeros)
  float* ds_out;       // [N, HV, K, V] adjoint of the state entering the window
  float* dSc;          // [NHV, c_count, K, V] adjoint of the state leaving each chunk
  float* dVn;          // [NHV, c_count·kC, V]
  float *dq, *dk, *dv, *dbeta, *dg;  // zero-filled by the caller; added into
};

__device__ __forceinline__ int64_t state_slot(const ChunkDev& p, int n, int hv, int cw) {
  return ((int64_t(n) * p.HV + hv) * p.c_count + cw) * p.K * p.V;
}

// Scratch row of token `t` (within the window) of (n, hv).
__device__ __forceinline__ int64_t srow(const ChunkDev& p, int n, int hv, int t) {
  return (int64_t(n) * p.HV + hv) * (int64_t(p.c_count) * kC) + t;
}

// Which (sequence, value head, chunk) a per-chunk block owns: blockIdx.x = sequence × HV + value
// head (any count), blockIdx.y = the chunk within the window (window_of keeps it ≤ 65,535). nv =
// the chunk's real rows (≤ 0: past the sequence's end), r0 = its first token row.
struct ChunkIds {
  int n, hv, cw, nv;
  int64_t r0;
};
__device__ __forceinline__ ChunkIds chunk_ids(const ChunkDev& p) {
  const int n = int(blockIdx.x) / p.HV, hv = int(blockIdx.x) % p.HV, cw = int(blockIdx.y);
  const int64_t t0 = int64_t(p.c_begin + cw) * kC, left = p.len[n] - t0;
  return {n, hv, cw, int(left < kC ? left : int64_t(kC)), p.row0[n] + t0};
}

// G [kC][KP] (KP = K + 1 unless given) = the cumulative log-decays of the chunk's rows (0 past nv): the gates are loaded
// by the whole block at once, then each channel is summed in double (differences of large sums
// keep their digits), scaled by `unit` (log₂ e for log₂ units). Ends with __syncthreads.
__device__ __forceinline__ void load_cumsum(float* G, const ChunkDev& p, int64_t r0, int nv, int hv, int threads,
                                            double unit = 1.0, int KP = 0) {
  const int K = p.K;
  if (KP == 0) KP = K + 1;
  if (p.decay == 2 && K % 4 == 0 && reinterpret_cast<uintptr_t>(p.g) % 16 == 0) {  // per-channel gates, four per load
    const int k4 = K / 4;
    for (int i = threadIdx.x; i < kC * k4; i += threads) {
      const int r = i / k4, d = 4 * (i % k4);
      float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < nv) g = *reinterpret_cast<const float4*>(p.g + ((r0 + r) * p.HV + hv) * K + d);
      if (KP % 4 == 0)  // rows 16-byte aligned: one store, no bank conflicts between lanes
        *reinterpret_cast<float4*>(G + r * KP + d) = g;
      else
        G[r * KP + d] = g.x, G[r * KP + d + 1] = g.y, G[r * KP + d + 2] = g.z, G[r * KP + d + 3] = g.w;
    }
  } else
  for (int i = threadIdx.x; i < kC * K; i += threads) {
    const int r = i / K, d = i % K;
    float g = 0.0f;
    if (r < nv && p.decay == 1) g = p.g[(r0 + r) * p.HV + hv];
    if (r < nv && p.decay == 2) g = p.g[((r0 + r) * p.HV + hv) * K + d];
    G[r * KP + d] = g;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < K; d += threads) {
    double acc = 0.0;
    for (int r = 0; r < kC; ++r) {
      acc += G[r * KP + d];
      G[r * KP + d] = float(acc * unit);
    }
  }
  __syncthreads();
}

// Offset of the address a lane gives ldmatrix_x4 for the TF32 A fragment of rows r0.. (16 rows
// `ld` floats apart, ld % 4 == 0) at column 0: row r0 + l % 16 … as device::ldmatrix_x4 says.
__device__ __forceinline__ int lane_row(int lane, int r0, int ld) {
  return (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 4 * (lane >> 4);
}

// Copies a chunk's [kC, KS] slab of K-wide scratch into shared memory.
__device__ __forceinline__ void load_slab(float* dst, const float* src, int KS) {
  const float4* s4 = reinterpret_cast<const float4*>(src);
  float4* d4 = reinterpret_cast<float4*>(dst);
  for (int i = threadIdx.x; i < kC * KS / 4; i += kRecThreads) d4[i] = s4[i];
}

// Asynchronous copies into shared memory (cp.async): the next chunk's operands load while the
// current one is computed. `async_slab` is load_slab's; `async_tile` copies a [kC, kVb] tile of a
// [rows, V] array (columns c0…, zeros past V).
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool ok) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void async_slab(float* dst, const float* src, int floats) {
  for (int i = 4 * int(threadIdx.x); i < floats; i += 4 * kRecThreads) cp_async16(dst + i, src + i);
}
__device__ __forceinline__ void async_tile(float* dst, const float* src, int V, int c0) {
  for (int i = threadIdx.x; i < kC * kVb; i += kRecThreads) {
    const int r = i / kVb, jj = i % kVb;
    const bool ok = c0 + jj < V;
    cp_async4(dst + i, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
  }
}

// The TF32 tensor-core forms of recur and output (bf16 storage, K a multiple of 16: `tc`), the
// same products on mma.sync m16n8k8 with fp32 accumulation. Shared-memory rows are padded so that
// fragment reads meet no bank conflicts: row strides ≡ 4 (mod 32 words) where a fragment's 8
// groups read 8 rows (A-style: W, Qg, Aqk), ≡ 8 where its 4 quad lanes read 4 rows (B-style: S,
// V_new, Kd read transposed).
constexpr int kPadA = 4, kPadB = 8;

// Rows of q4 16-byte pieces (q4 ≤ 32) split over a block's warps: a warp takes 32 / P rows at a
// time (P = q4 rounded up to a power of two), lane → (row lane / P of those, piece c = lane % P);
// lanes with c ≥ q4 idle. No division, and a thread's addresses only step by whole rows.
struct RowLanes {
  int c, first, step;
  bool on;
  __device__ __forceinline__ RowLanes(int q4, int threads) {
    const int sh = 32 - __clz(q4 - 1), lane = int(threadIdx.x) % 32;  // P = 2^sh
    c = lane & ((1 << sh) - 1);
    first = (int(threadIdx.x) / 32) * (32 >> sh) + (lane >> sh);
    step = (threads / 32) * (32 >> sh);
    on = c < q4;
  }
};

// Copies a chunk's [kC, cols] slab into shared memory rows `ld` floats apart (cp.async), both
// addresses stepped by whole rows (a shared address and a pointer add each) rather than recomputed.
__device__ __forceinline__ void async_rows(float* dst, int ld, const float* src, int cols, int threads) {
  const RowLanes w(cols / 4, threads);
  if (!w.on) return;
  unsigned d = device::smem_u32(dst + w.first * ld + 4 * w.c);
  const float* s = src + w.first * cols + 4 * w.c;
  const unsigned dstep = unsigned(w.step * ld) * sizeof(float);
  const int sstep = w.step * cols;
#pragma unroll 4
  for (int r = w.first; r < kC; r += w.step, d += dstep, s += sstep) device::cp_async16(d, s);
}
// A [rows, cols] tile (columns c0…, zeros past V) of a [·, V] array into rows `ld` floats apart:
// 16-byte copies when V is a multiple of 4, else one float at a time.
__device__ __forceinline__ void async_cols(float* dst, int ld, const float* src, int V, int c0, int cols, int rows,
                                           int threads) {
  if (V % 4 == 0) {
    const RowLanes w(cols / 4, threads);
    if (!w.on) return;
    const int jj = 4 * w.c;
    const bool ok = c0 + jj < V;
    for (int r = w.first; r < rows; r += w.step)
      device::cp_async16_zfill(dst + r * ld + jj, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
  } else {
    for (int i = int(threadIdx.x); i < rows * cols; i += threads) {
      const int r = i / cols, jj = i % cols;
      const bool ok = c0 + jj < V;
      cp_async4(dst + r * ld + jj, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
    }
  }
}

// One launch of each stage over NHV (sequence, value head) pairs of the window in `d`, on the
// device's stream. `io` is the storage type of q/k/v (the tensor-core forms need BF16 and d.tc).
void launch_prepare(const ChunkDev& d, int64_t NHV, DType io);
void launch_recur(const ChunkDev& d, int64_t NHV);
void launch_output(const ChunkDev& d, int64_t NHV, DType io);
void launch_reverse(const ChunkDev& d, int64_t NHV);
void launch_grads(const ChunkDev& d, int64_t NHV, DType io);

}  // namespace k3::linear::detail
