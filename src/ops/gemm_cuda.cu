// Row-major GEMM through cuBLASLt: fp32 (no TF32: CUBLAS_COMPUTE_32F) and bf16 operands with fp32
// accumulation, fp32 or (bf16 operands) bf16 output. cuBLASLt is column-major, so the row-major C = op(A) op(B) is
// computed as the column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage is Lt's first operand.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw error("cublas", what, " failed with status ", int(s));
}

struct Lt {
  cublasLtHandle_t handle = nullptr;
  device::Buffer workspace;
  Lt() {
    lt_check(cublasLtCreate(&handle), "cublasLtCreate");
    workspace = device::Buffer(size_t(32) << 20);
  }
};

Lt& lt() {
  static Lt* l = new Lt();  // lives for the process (like the allocator)
  return *l;
}

}  // namespace

namespace {

// A GEMM's cuBLASLt descriptors and chosen algorithm, made once per shape: the heuristic query
// and descriptor set-up cost more host time than a small decode GEMM takes on the device.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool bias_bf16 = false;  // the epilogue reads a bf16 bias (cuBLASLt's choice for bf16 outputs)
  bool none = false;       // cuBLASLt has no algorithm for the epilogue asked for: compose it
};

struct PlanKey {
  int64_t v[12];
  bool operator==(const PlanKey& o) const { return std::equal(v, v + 12, o.v); }
};
struct PlanHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ size_t(x)) * 1099511628211ull;
    return h;
  }
};

constexpr int kCandidates = 8;  // the heuristic's algorithms a tuned shape times

// epi: the GELU epilogues (GemmOut). cands (may be null) receives the heuristic's first
// kCandidates algorithms, its best guess first.
Plan make_plan(Op ta, Op tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, Storage st,
               Storage out_st, bool bias, Epilogue epi, std::vector<cublasLtMatmulAlgo_t>* cands = nullptr) {
  const int64_t a_cols = ta == Op::N ? K : M, b_cols = tb == Op::N ? N : K;
  const cudaDataType_t in = st == Storage::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t out = out_st == Storage::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  Plan p;
  lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // Lt's first operand is B's storage (col-major [b_cols, rows]); transposed iff tb == T.
  const cublasOperation_t opa = tb == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = ta == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "set TRANSB");
  cublasLtEpilogue_t mode = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  if (epi == Epilogue::Gelu) mode = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  if (epi == Epilogue::GeluGrad) mode = CUBLASLT_EPILOGUE_DGELU;
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &mode, sizeof mode), "set EPILOGUE");
  if (epi != Epilogue::None) {  // the pre-activation: [M, N] row-major, Lt's [N, M] with ld N
    const int64_t aux_ld = N;
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
             "set EPILOGUE_AUX_LD");
  }
  if (bias) {  // the vector runs along Lt's rows, row-major C's columns; its pointer is set per call
    // An fp32 bias where the output is fp32; a bf16 output's epilogue takes the output's type.
    p.bias_bf16 = out == CUDA_R_16BF;
    const cudaDataType_t bias_type = p.bias_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
             "set BIAS_DATA_TYPE");
  }
  // Stored col-major shapes: B as [b_cols, b_rows], A as [a_cols, a_rows], C as [N, M].
  const int64_t b_rows = tb == Op::N ? K : N, a_rows = ta == Op::N ? M : K;
  lt_check(cublasLtMatrixLayoutCreate(&p.la, in, uint64_t(b_cols), uint64_t(b_rows), ldb), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&p.lb, in, uint64_t(a_cols), uint64_t(a_rows), lda), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&p.lc, out, uint64_t(N), uint64_t(M), ldc), "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t ws = lt().workspace.bytes();
  lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "workspace preference");
  cublasLtMatmulHeuristicResult_t heur[kCandidates]{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt().handle, p.op, p.la, p.lb, p.lc, p.lc, pref,
                                                            cands ? kCandidates : 1, heur, &found);
  if (hs != CUBLAS_STATUS_SUCCESS && epi != Epilogue::None) found = 0;  // an epilogue it lacks: composed
  else lt_check(hs, "heuristic");
  if (cands)
    for (int i = 0; i < found; ++i)
      if (heur[i].state == CUBLAS_STATUS_SUCCESS) cands->push_back(heur[i].algo);
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0 && epi != Epilogue::None) {
    p.none = true;  // the caller composes the epilogue
    return p;
  }
  if (found == 0) throw error("cublas", "no cuBLASLt algorithm for a ", M, "x", N, "x", K, " GEMM");
  p.algo = heur[0].algo;
  return p;
}

struct PlanCache {
  static constexpr size_t kMax = 16384;  // shapes; past this, plans are made and dropped per call
  std::mutex mu;
  std::unordered_map<PlanKey, Plan, PlanHash> plans;
};
PlanCache& plans() {
  static PlanCache* c = new PlanCache();  // lives for the process, like the handle
  return *c;
}

void destroy(Plan& p) {
  cublasLtMatrixLayoutDestroy(p.la);
  cublasLtMatrixLayoutDestroy(p.lb);
  cublasLtMatrixLayoutDestroy(p.lc);
  cublasLtMatmulDescDestroy(p.op);
}

std::atomic<int> g_tuning{-1};  // -1: from K3_GEMM_TUNE on first use

// The fastest of a new shape's candidate algorithms, each run once and then timed over 3 runs into
// scratch outputs (beta 0; a Gelu epilogue's aux into scratch too), so the caller's arrays are
// left as they are. Skipped (the heuristic's first) while the stream is being captured into a
// graph or when the scratch arrays cannot be had.
template <class Matmul>
cublasLtMatmulAlgo_t fastest(const std::vector<cublasLtMatmulAlgo_t>& cands, const Plan& plan, const GemmOut& out,
                             int64_t M, int64_t ldc, Matmul matmul) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  K3_CUDA_CHECK(cudaStreamIsCapturing(device::stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone) return cands[0];
  const size_t esize = out.st == Storage::BF16 ? 2 : 4, bytes = size_t(M) * size_t(ldc) * esize;
  device::Buffer d, aux;
  try {
    d = device::Buffer(bytes);
    if (out.epi == Epilogue::Gelu) aux = device::Buffer(bytes);
  } catch (const Error&) {
    return cands[0];
  }
  void* const aux_ptr = aux.get();
  if (aux_ptr)
    lt_check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr,
                                            sizeof aux_ptr),
             "set EPILOGUE_AUX_POINTER");
  cublasLtMatmulAlgo_t best = cands[0];
  double best_ms = 1e30;
  device::Timer timer;
  for (const cublasLtMatmulAlgo_t& algo : cands) {
    if (matmul(algo, d.get(), d.get(), 0.0f) != CUBLAS_STATUS_SUCCESS) continue;
    timer.start();
    for (int r = 0; r < 3; ++r) matmul(algo, d.get(), d.get(), 0.0f);
    const double ms = timer.stop_ms();
    if (ms < best_ms) best_ms = ms, best = algo;
  }
  if (aux_ptr)
    lt_check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &out.aux,
                                            sizeof out.aux),
             "set EPILOGUE_AUX_POINTER");
  return best;
}

}  // namespace

void set_gemm_tuning(bool on) { g_tuning = on ? 1 : 0; }
bool gemm_tuning() {
  int t = g_tuning.load();
  if (t < 0) {
    const char* e = std::getenv("K3_GEMM_TUNE");
    t = e && e[0] == '1' ? 1 : 0;
    g_tuning = t;
  }
  return t == 1;
}

void gemm(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
          int64_t ldb, float beta, float* C, int64_t ldc, Storage st, const float* bias) {
  gemm_out(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, GemmOut{C, Storage::F32, nullptr, bias}, ldc, st);
}

void gemm_out(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
              int64_t ldb, float beta, const GemmOut& out, int64_t ldc, Storage st) {
  if (M == 0 || N == 0) return;
  device::require_cuda("gemm");
  if (out.st == Storage::BF16 && st != Storage::BF16)
    throw error("gemm", "a bf16 output needs bf16 operands (fp32 operands write fp32)");
  if (lda == 0) lda = ta == Op::N ? K : M;  // row-major A is [M, K] or [K, M]
  if (ldb == 0) ldb = tb == Op::N ? N : K;
  if (ldc == 0) ldc = N;
  const bool gelu = out.epi != Epilogue::None;
  if (gelu && (out.st != Storage::BF16 || ldc != N || !out.aux || beta != 0.0f || out.c))
    throw error("gemm", "a GELU epilogue needs a bf16 output of contiguous rows, its aux array and beta = 0");
  if (gelu && out.epi == Epilogue::GeluGrad && out.bias) throw error("gemm", "the GELU's gradient takes no bias");
  Plan plan;
  bool owned = false;
  Lt& l = lt();
  const float* bias = out.bias;
  PlanCache& cache = plans();
  std::unique_lock<std::mutex> lock(cache.mu);
  std::vector<cublasLtMatmulAlgo_t> cands;  // a new shape's candidates when tuning
  const PlanKey key{{int64_t(ta), int64_t(tb), M, N, K, lda, ldb, ldc, int64_t(st), int64_t(out.st),
                     bias != nullptr, int64_t(out.epi)}};
  // The GELU epilogues want N % 8 = 0 and, as the plans assume, 16-byte-aligned D and aux.
  const bool aligned = ((reinterpret_cast<uintptr_t>(out.d) | reinterpret_cast<uintptr_t>(out.aux)) & 15) == 0;
  if (!gelu || (N % 8 == 0 && aligned)) {
    auto it = cache.plans.find(key);
    if (it != cache.plans.end()) {
      plan = it->second;
    } else {
      // Tuned only where the plan will be kept (a full cache makes plans per call).
      const bool tune = gemm_tuning() && cache.plans.size() < PlanCache::kMax;
      plan = make_plan(ta, tb, M, N, K, lda, ldb, ldc, st, out.st, bias != nullptr, out.epi, tune ? &cands : nullptr);
      if (cache.plans.size() < PlanCache::kMax) cache.plans.emplace(key, plan);
      else owned = true;
    }
  } else {
    plan.none = true;
  }
  if (plan.none) {  // the epilogue composed: the plain GEMM, then the elementwise kernel
    lock.unlock();
    if (owned) destroy(plan);
    GemmOut plain{out.d, out.st, out.c, out.bias};
    if (out.epi == Epilogue::Gelu) plain.d = out.aux;  // the pre-activation first
    gemm_out(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, plain, ldc, st);
    if (out.epi == Epilogue::Gelu) gelu_tanh_forward(out.aux, out.d, M * N, Storage::BF16);
    if (out.epi == Epilogue::GeluGrad) gelu_tanh_backward(out.aux, out.d, out.d, M * N, Storage::BF16);
    return;
  }
  device::Buffer bias_b;  // the bias rounded to bf16 where the plan's epilogue reads bf16
  const void* bias_ptr = bias;
  if (bias && plan.bias_bf16) {
    bias_b = device::Buffer(size_t(N) * 2);
    cast(bias, bias_b.get(), N, Storage::BF16);
    bias_ptr = bias_b.get();
  }
  // A plan with a vector or aux array takes their addresses as descriptor attributes: the lock
  // covers setting them and enqueueing the product, so no other thread's call sees them between.
  if (bias_ptr)
    lt_check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof bias_ptr),
             "set BIAS_POINTER");
  if (gelu)
    lt_check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &out.aux,
                                            sizeof out.aux),
             "set EPILOGUE_AUX_POINTER");
  const size_t ws = l.workspace.bytes();
  auto matmul = [&](const cublasLtMatmulAlgo_t& algo, const void* c, void* d, float b) {
    return cublasLtMatmul(l.handle, plan.op, &alpha, B, plan.la, A, plan.lb, &b, c, plan.lc, d, plan.lc, &algo,
                          l.workspace.get(), ws, device::stream());
  };
  if (cands.size() > 1) {
    plan.algo = fastest(cands, plan, out, M, ldc, matmul);
    if (!owned) cache.plans[key].algo = plan.algo;
  }
  if (!bias_ptr && !gelu) lock.unlock();
  const void* addend = out.c ? out.c : out.d;  // beta's C: D itself unless another array is named
  const cublasStatus_t status = matmul(plan.algo, addend, out.d, beta);
  if (lock.owns_lock()) lock.unlock();
  if (owned) destroy(plan);
  lt_check(status, "cublasLtMatmul");
}

namespace {
// Grouped C_i [M_i, N_i] = A_i [M_i, K] · B_i [N_i, K]ᵀ for the decode step's small M (a few
// hundred rows at most): a block of 256 threads per 64 × 64 tile of one problem. At these sizes a
// call costs the latency of its loads, not their bytes, so when every operand row can be read in
// 16-byte pieces (`vector`) K streams through a ring of 6 stages of 64 bytes of each row
// (cp.async; 5 stages in flight while one is multiplied): one load latency per 5 steps. Otherwise
// (ragged K, unaligned operands) K goes in steps of 32 through shared memory, the next step's
// operands loaded into registers while this step's products run.
// - bf16 operands: on the tensor cores (mma m16n8k16: exact products, fp32 sums), each warp 16
//   rows × 32 columns of the tile.
// - fp32 operands: fp32 FMAs, each thread 4 × 4 outputs (fp32 weights are the exact mode: 3xTF32
//   products would give relative errors of ~3e-5 at K = 4096, against ~1e-6 here).
// The problems travel in the launch's parameters (64 per launch), not as an upload per call:
// blockIdx.y picks the problem, blockIdx.x its tile. K is not split across blocks: summing the
// partials costs more than the extra parallelism gives at these sizes. cuBLAS's grouped GEMM runs
// these shapes as a SIMT kernel of 128 × 128 tiles with unaligned loads (~67 µs per call).
constexpr int kGT = 64, kGK = 32, kGThreads = 256, kGPerLaunch = 64;
constexpr int64_t kGroupedMaxM = 256;  // larger M: one library GEMM per problem
struct GroupedTile {
  const void* A;
  const void* B;
  float* C;
  int M, N, n_tiles, tiles;
};
struct GroupedArgs {
  GroupedTile p[kGPerLaunch];
  int G, K;
  bool vector;  // K a whole number of 16-byte pieces and every operand 16-byte aligned
};

// Eight consecutive bf16 elements of one row, loaded one by one (zeros past the row's end: the
// rows this path takes are ragged or unaligned) and stored to shared memory as 16 bytes.
struct Eight {
  uint4 v;
  __device__ void load(const __nv_bfloat16* p, int n) {  // n: elements in range (≤ 8)
    alignas(16) __nv_bfloat16 e[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = j < n ? p[j] : __float2bfloat16(0.0f);
    v = *reinterpret_cast<const uint4*>(e);
  }
  __device__ void store(__nv_bfloat16* dst) const { *reinterpret_cast<uint4*>(dst) = v; }
};

// Row padding of the bf16 tiles: fragment reads of 8 rows × 4 words then hit 32 banks.
constexpr int kGRow = kGK + 8;

// acc[j] += the warp's 16 rows of As × its j-th 8 columns of Bs, over one 32-wide step of K.
__device__ __forceinline__ void step_products(const __nv_bfloat16 (*As)[kGRow], const __nv_bfloat16 (*Bs)[kGRow],
                                              int r0, int c0, int g, int t, float (&acc)[4][4]) {
  auto word = [](const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); };
#pragma unroll
  for (int kk = 0; kk < kGK; kk += 16) {
    const uint32_t a[4] = {word(&As[r0 + g][kk + 2 * t]), word(&As[r0 + g + 8][kk + 2 * t]),
                           word(&As[r0 + g][kk + 2 * t + 8]), word(&As[r0 + g + 8][kk + 2 * t + 8])};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      device::mma_bf16(acc[j], a, word(&Bs[c0 + 8 * j + g][kk + 2 * t]), word(&Bs[c0 + 8 * j + g][kk + 2 * t + 8]));
  }
}

__global__ void __launch_bounds__(kGThreads, 2) grouped_bf16_kernel(const __grid_constant__ GroupedArgs args) {
  using T = __nv_bfloat16;
  const GroupedTile& P = args.p[blockIdx.y];
  const int tile = int(blockIdx.x);
  if (tile >= P.tiles) return;  // a smaller problem than the launch's largest
  const int m0 = tile / P.n_tiles * kGT, n0 = tile % P.n_tiles * kGT, K = args.K;
  __shared__ __align__(16) T As[kGT][kGRow];
  __shared__ __align__(16) T Bs[kGT][kGRow];  // [row of A or B][k]
  // Staging: each thread loads eight consecutive k of one row of A and of B per step.
  static_assert(kGT * kGK == 8 * kGThreads, "one row segment of eight per thread and operand");
  const int sr = int(threadIdx.x) / (kGK / 8), sk = int(threadIdx.x) % (kGK / 8) * 8;
  const T* a_row = static_cast<const T*>(P.A) + int64_t(min(m0 + sr, P.M - 1)) * K + sk;
  const T* b_row = static_cast<const T*>(P.B) + int64_t(min(n0 + sr, P.N - 1)) * K + sk;
  const bool a_in = m0 + sr < P.M, b_in = n0 + sr < P.N;
  Eight ra, rb;
  auto fetch = [&](int k0) {
    const int n = max(0, min(8, K - (k0 + sk)));
    ra.load(a_row + k0, a_in ? n : 0);
    rb.load(b_row + k0, b_in ? n : 0);
  };
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int r0 = warp / 2 * 16, c0 = warp % 2 * 32;  // the warp's rows and columns in the tile
  float acc[4][4] = {};
  fetch(0);
  for (int k0 = 0; k0 < K; k0 += kGK) {
    ra.store(&As[sr][sk]);
    rb.store(&Bs[sr][sk]);
    __syncthreads();
    if (k0 + kGK < K) fetch(k0 + kGK);  // in flight while this step's products run
    step_products(As, Bs, r0, c0, g, t, acc);
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int m = m0 + r0 + g + (c / 2) * 8, n = n0 + c0 + 8 * j + 2 * t + c % 2;
      if (m < P.M && n < P.N) P.C[int64_t(m) * P.N + n] = acc[j][c];
    }
}

__global__ void __launch_bounds__(kGThreads) grouped_f32_kernel(const __grid_constant__ GroupedArgs args) {
  const GroupedTile& P = args.p[blockIdx.y];
  const int tile = int(blockIdx.x);
  if (tile >= P.tiles) return;  // a smaller problem than the launch's largest
  const int m0 = tile / P.n_tiles * kGT, n0 = tile % P.n_tiles * kGT, K = args.K;
  const float* A = static_cast<const float*>(P.A);
  const float* B = static_cast<const float*>(P.B);
  __shared__ float As[kGK][kGT + 1], Bs[kGK][kGT + 1];  // [k][row of A or B]
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  constexpr int kPer = kGT * kGK / kGThreads;  // operand elements each thread stages per step
  float ra[kPer], rb[kPer];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = int(threadIdx.x) + kGThreads * i, r = e / kGK, k = k0 + e % kGK;
      ra[i] = m0 + r < P.M && k < K ? A[int64_t(m0 + r) * K + k] : 0.0f;
      rb[i] = n0 + r < P.N && k < K ? B[int64_t(n0 + r) * K + k] : 0.0f;
    }
  };
  float acc[4][4] = {};
  fetch(0);
  for (int k0 = 0; k0 < K; k0 += kGK) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = int(threadIdx.x) + kGThreads * i;
      As[e % kGK][e / kGK] = ra[i];
      Bs[e % kGK][e / kGK] = rb[i];
    }
    __syncthreads();
    if (k0 + kGK < K) fetch(k0 + kGK);  // in flight while this step's products run
#pragma unroll 8
    for (int kk = 0; kk < kGK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i], b[i] = Bs[kk][tx + 16 * i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < P.M && n < P.N) P.C[int64_t(m) * P.N + n] = acc[i][j];
    }
}

// The ring. Stage s holds kK values of K of the tile's 64 rows of A and of B: bf16 64 values (128
// bytes, rows padded to 144: ldmatrix's eight rows then fall on distinct banks), 4 stages; fp32 16
// values (64 bytes, rows padded to 80: float4 reads of eight rows on distinct banks), 6 stages.
// Each thread copies whole 16-byte pieces. Per stage a warp issues few instructions beside its
// products (the kernel is issue-bound at these sizes: ncu, 2 warps per scheduler).
template <class T>
struct Ring;
template <>
struct Ring<__nv_bfloat16> {
  static constexpr int kK = 64, kRowBytes = 144, kStages = 4;
};
template <>
struct Ring<float> {
  static constexpr int kK = 16, kRowBytes = 80, kStages = 6;
};
template <class T>
constexpr int ring_bytes() {
  return Ring<T>::kStages * 2 * kGT * Ring<T>::kRowBytes;  // 73,728 and 61,440: dynamic shared memory
}

template <class T>
__global__ void __launch_bounds__(kGThreads, 2) grouped_ring_kernel(const __grid_constant__ GroupedArgs args) {
  constexpr int kK = Ring<T>::kK, kStages = Ring<T>::kStages, kRow = Ring<T>::kRowBytes / int(sizeof(T));
  constexpr int kPiece = 16 / int(sizeof(T)), kPieces = kK / kPiece;  // 16-byte pieces per row and stage
  constexpr int kRowsPerPass = kGThreads / kPieces, kPasses = kGT / kRowsPerPass;
  using Stage = T[2][kGT][kRow];  // [A or B][row][k]
  extern __shared__ __align__(16) unsigned char ring_smem[];
  Stage* ring = reinterpret_cast<Stage*>(ring_smem);
  const GroupedTile& P = args.p[blockIdx.y];
  const int tile = int(blockIdx.x);
  if (tile >= P.tiles) return;  // a smaller problem than the launch's largest
  const int m0 = tile / P.n_tiles * kGT, n0 = tile % P.n_tiles * kGT, K = args.K, M = P.M, N = P.N;
  const int sr = int(threadIdx.x) / kPieces, sk = int(threadIdx.x) % kPieces * kPiece;  // first row, piece
  // Rows past M or N read the last row (in bounds; their products are never stored).
  const T* a_src[kPasses];
  const T* b_src[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    a_src[p] = static_cast<const T*>(P.A) + int64_t(min(m0 + sr + p * kRowsPerPass, M - 1)) * K + sk;
    b_src[p] = static_cast<const T*>(P.B) + int64_t(min(n0 + sr + p * kRowsPerPass, N - 1)) * K + sk;
  }
  const int steps = (K + kK - 1) / kK;
  auto issue = [&](int s, int slot) {  // stage s's copies into `slot` (zeros past K), then a group
    if (s < steps) {
      const int k = s * kK;
      const bool in = k + sk < K;  // K is a multiple of kPiece: a piece is all in or all out
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        device::cp_async16_zfill(&ring[slot][0][sr + p * kRowsPerPass][sk], in ? a_src[p] + k : a_src[p], in);
        device::cp_async16_zfill(&ring[slot][1][sr + p * kRowsPerPass][sk], in ? b_src[p] + k : b_src[p], in);
      }
    }
    device::cp_async_commit();  // empty or not: the group count stays one per stage
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s, s);
  float acc[4][4] = {};
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  int slot = 0;
  for (int s = 0; s < steps; ++s) {
    device::cp_async_wait<kStages - 2>();  // this thread's pieces of stage s have landed
    __syncthreads();                       // everyone's; and stage s − 1's slot is no longer read
    issue(s + kStages - 1, slot == 0 ? kStages - 1 : slot - 1);
    const Stage& st = ring[slot];
    slot = slot == kStages - 1 ? 0 : slot + 1;
    if constexpr (sizeof(T) == 2) {
      // Each warp 16 rows × 32 columns of the tile on the tensor cores; fragments by ldmatrix (A:
      // lanes 0–15 rows at k, 16–31 the same rows at k + 8; B: matrix i of the x4 is columns
      // 8·(2h + i / 2)… at k + 8·(i % 2)).
      const int r0 = warp / 2 * 16, c0 = warp % 2 * 32;
#pragma unroll
      for (int kk = 0; kk < kK; kk += 16) {
        uint32_t a[4], b[2][4];
        device::ldmatrix_x4(a, &st[0][r0 + lane % 16][kk + lane / 16 * 8]);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          device::ldmatrix_x4(b[h], &st[1][c0 + 16 * h + lane / 16 * 8 + lane % 8][kk + lane / 8 % 2 * 8]);
#pragma unroll
        for (int j = 0; j < 4; ++j) device::mma_bf16(acc[j], a, b[j / 2][j % 2 * 2], b[j / 2][j % 2 * 2 + 1]);
      }
    } else {
      // fp32 FMAs, each thread rows ty + 16i × columns tx + 16j, k in order.
      const int tx = int(threadIdx.x) & 15, ty = int(threadIdx.x) >> 4;
#pragma unroll
      for (int kk = 0; kk < kK; kk += 4) {
        float4 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[i] = *reinterpret_cast<const float4*>(&st[0][ty + 16 * i][kk]);
          b[i] = *reinterpret_cast<const float4*>(&st[1][tx + 16 * i][kk]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
            acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
            acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
            acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
          }
      }
    }
  }
  device::cp_async_wait<0>();  // no copy outlives the block (the tail's groups are empty)
  if constexpr (sizeof(T) == 2) {
    const int r0 = warp / 2 * 16, c0 = warp % 2 * 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int m = m0 + r0 + g + (c / 2) * 8, n = n0 + c0 + 8 * j + 2 * t + c % 2;
        if (m < M && n < N) P.C[int64_t(m) * N + n] = acc[j][c];
      }
  } else {
    const int tx = int(threadIdx.x) & 15, ty = int(threadIdx.x) >> 4;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
        if (m < M && n < N) P.C[int64_t(m) * N + n] = acc[i][j];
      }
  }
}

template <class T>
void launch_ring(const GroupedArgs& args, dim3 grid) {
  static const bool attributes_set = [] {
    K3_CUDA_CHECK(
        cudaFuncSetAttribute(grouped_ring_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes<T>()));
    return true;
  }();
  (void)attributes_set;
  grouped_ring_kernel<T><<<grid, kGThreads, ring_bytes<T>(), device::stream()>>>(args);
}

void launch_grouped(const GroupedArgs& args, int max_tiles, Storage st) {
  const dim3 grid(unsigned(max_tiles), unsigned(args.G));
  if (args.vector && st == Storage::BF16) launch_ring<__nv_bfloat16>(args, grid);
  else if (args.vector) launch_ring<float>(args, grid);
  else if (st == Storage::BF16) grouped_bf16_kernel<<<grid, kGThreads, 0, device::stream()>>>(args);
  else grouped_f32_kernel<<<grid, kGThreads, 0, device::stream()>>>(args);
  K3_CUDA_LAUNCHED();
}
}  // namespace

void gemm_nt_grouped(int64_t N, int64_t K, const std::vector<GemmProblem>& problems, Storage st) {
  std::vector<GemmProblem> ps;
  int64_t max_m = 0;
  for (GemmProblem p : problems) {
    if (p.N <= 0) p.N = N;
    if (p.M > 0 && p.N > 0) ps.push_back(p), max_m = std::max(max_m, p.M);
  }
  if (ps.empty()) return;
  device::require_cuda("gemm");
  if (max_m > kGroupedMaxM || K > INT32_MAX / 2) {
    for (const GemmProblem& p : ps) gemm(Op::N, Op::T, p.M, p.N, K, 1.0f, p.A, K, p.B, K, 0.0f, p.C, p.N, st);
    return;
  }
  GroupedArgs args{};
  args.K = int(K);
  int max_tiles = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    const GemmProblem& p = ps[i];
    if (p.N > INT32_MAX / 2) throw error("gemm", "grouped: N = ", p.N, " exceeds 32-bit sizes");
    const int64_t mt = (p.M + kGT - 1) / kGT, nt = (p.N + kGT - 1) / kGT;
    if (mt * nt > INT32_MAX) throw error("gemm", "grouped: ", mt * nt, " tiles exceed the grid");
    if (args.G == 0) args.vector = K % (st == Storage::BF16 ? 8 : 4) == 0;  // whole 16-byte pieces per row
    args.vector = args.vector && reinterpret_cast<uintptr_t>(p.A) % 16 == 0 && reinterpret_cast<uintptr_t>(p.B) % 16 == 0;
    args.p[args.G++] = {p.A, p.B, p.C, int(p.M), int(p.N), int(nt), int(mt * nt)};
    max_tiles = std::max(max_tiles, int(mt * nt));
    if (args.G == kGPerLaunch || i + 1 == ps.size()) {
      launch_grouped(args, max_tiles, st);
      args.G = 0, max_tiles = 0;
    }
  }
}

namespace {
// The cuBLAS (not Lt) handle of the strided-batched GEMMs, shared under a lock.
struct Blas {
  cublasHandle_t handle = nullptr;
  std::mutex mu;
};
Blas& blas() {
  static Blas* b = [] {
    auto* x = new Blas();
    lt_check(cublasCreate(&x->handle), "cublasCreate");
    return x;
  }();
  return *b;
}
}  // namespace

void gemm_strided(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, int64_t sa,
                  const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc, int64_t sc,
                  int64_t count) {
  if (M == 0 || N == 0 || count == 0) return;
  device::require_cuda("gemm");
  for (int64_t v : {M, N, K, lda, ldb, ldc, count})
    if (v > INT32_MAX) throw error("gemm", "strided batch: size ", v, " exceeds the library's 32-bit sizes");
  Blas& g = blas();
  std::lock_guard<std::mutex> lock(g.mu);
  lt_check(cublasSetStream(g.handle, device::stream()), "cublasSetStream");
  // Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ: the operands swap, the ops stay.
  const auto op = [](Op o) { return o == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T; };
  lt_check(cublasGemmStridedBatchedEx(g.handle, op(tb), op(ta), int(N), int(M), int(K), &alpha, B, CUDA_R_32F, int(ldb),
                                      sb, A, CUDA_R_32F, int(lda), sa, &beta, C, CUDA_R_32F, int(ldc), sc, int(count),
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
           "cublasGemmStridedBatchedEx");
}

}  // namespace k3::cuda
