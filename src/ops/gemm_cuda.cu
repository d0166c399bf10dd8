// Row-major GEMM through cuBLASLt: fp32 (no TF32: CUBLAS_COMPUTE_32F) and bf16 operands with fp32
// accumulation and fp32 output. cuBLASLt is column-major, so the row-major C = op(A) op(B) is
// computed as the column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage is Lt's first operand.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

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
};

struct PlanKey {
  int64_t v[9];
  bool operator==(const PlanKey& o) const { return std::equal(v, v + 9, o.v); }
};
struct PlanHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ size_t(x)) * 1099511628211ull;
    return h;
  }
};

Plan make_plan(Op ta, Op tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, Storage st) {
  const int64_t a_cols = ta == Op::N ? K : M, b_cols = tb == Op::N ? N : K;
  const cudaDataType_t in = st == Storage::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  Plan p;
  lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // Lt's first operand is B's storage (col-major [b_cols, rows]); transposed iff tb == T.
  const cublasOperation_t opa = tb == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = ta == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "set TRANSB");
  // Stored col-major shapes: B as [b_cols, b_rows], A as [a_cols, a_rows], C as [N, M].
  const int64_t b_rows = tb == Op::N ? K : N, a_rows = ta == Op::N ? M : K;
  lt_check(cublasLtMatrixLayoutCreate(&p.la, in, uint64_t(b_cols), uint64_t(b_rows), ldb), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&p.lb, in, uint64_t(a_cols), uint64_t(a_rows), lda), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&p.lc, CUDA_R_32F, uint64_t(N), uint64_t(M), ldc), "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t ws = lt().workspace.bytes();
  lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "workspace preference");
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(lt().handle, p.op, p.la, p.lb, p.lc, p.lc, pref, 1, &heur, &found),
           "heuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) throw error("cublas", "no cuBLASLt algorithm for a ", M, "x", N, "x", K, " GEMM");
  p.algo = heur.algo;
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

}  // namespace

void gemm(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
          int64_t ldb, float beta, float* C, int64_t ldc, Storage st) {
  if (M == 0 || N == 0) return;
  device::require_cuda("gemm");
  if (lda == 0) lda = ta == Op::N ? K : M;  // row-major A is [M, K] or [K, M]
  if (ldb == 0) ldb = tb == Op::N ? N : K;
  if (ldc == 0) ldc = N;
  Lt& l = lt();
  const PlanKey key{{int64_t(ta), int64_t(tb), M, N, K, lda, ldb, ldc, int64_t(st)}};
  PlanCache& cache = plans();
  Plan plan;
  bool owned = false;
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it != cache.plans.end()) {
      plan = it->second;
    } else {
      plan = make_plan(ta, tb, M, N, K, lda, ldb, ldc, st);
      if (cache.plans.size() < PlanCache::kMax) cache.plans.emplace(key, plan);
      else owned = true;
    }
  }
  const size_t ws = l.workspace.bytes();
  const cublasStatus_t status = cublasLtMatmul(l.handle, plan.op, &alpha, B, plan.la, A, plan.lb, &beta, C, plan.lc,
                                               C, plan.lc, &plan.algo, l.workspace.get(), ws, device::stream());
  if (owned) destroy(plan);
  lt_check(status, "cublasLtMatmul");
}

namespace {
struct Grouped {
  cublasHandle_t handle = nullptr;
  std::mutex mu;
};
Grouped& grouped() {
  static Grouped* g = [] {
    auto* x = new Grouped();
    lt_check(cublasCreate(&x->handle), "cublasCreate");
    return x;
  }();
  return *g;
}
}  // namespace

namespace {
// Grouped C_i [M_i, N_i] = A_i [M_i, K] · B_i [N_i, K]ᵀ for the decode step's small M (a few
// hundred rows at most): a block per 64 × 64 tile of one problem, K in steps of 32 through shared
// memory with the next step's operands prefetched into registers, each thread 4 × 4 outputs in
// fp32 (operands widened from bf16 when stored so). cuBLAS's grouped GEMM ran these shapes as a
// SIMT kernel of 128 × 128 tiles with unaligned loads, 67 µs per call where this reads each
// weight once.
constexpr int kGT = 64, kGK = 32, kGThreads = 256;
constexpr int64_t kGroupedMaxM = 256;  // larger M: one library GEMM per problem
struct GroupedTile {
  const void* A;
  const void* B;
  float* C;
  int M, N, n_tiles, tile0;
};
template <typename T>
__global__ void __launch_bounds__(kGThreads) grouped_nt_kernel(const GroupedTile* ps, int G, int K) {
  int lo = 0, hi = G - 1;  // the last problem whose first tile is at or before this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ps[mid].tile0 <= int(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  const GroupedTile P = ps[lo];
  const int t = int(blockIdx.x) - P.tile0, m0 = t / P.n_tiles * kGT, n0 = t % P.n_tiles * kGT;
  const T* A = static_cast<const T*>(P.A);
  const T* B = static_cast<const T*>(P.B);
  __shared__ float As[kGK][kGT + 1], Bs[kGK][kGT + 1];  // [k][row of A or B]
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  constexpr int kPer = kGT * kGK / kGThreads;  // operand elements each thread stages per step
  float ra[kPer], rb[kPer];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = int(threadIdx.x) + kGThreads * i, r = e / kGK, k = k0 + e % kGK;
      ra[i] = m0 + r < P.M && k < K ? device::to_f32(A[int64_t(m0 + r) * K + k]) : 0.0f;
      rb[i] = n0 + r < P.N && k < K ? device::to_f32(B[int64_t(n0 + r) * K + k]) : 0.0f;
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
  if (max_m > kGroupedMaxM || K > INT32_MAX) {
    for (const GemmProblem& p : ps) gemm(Op::N, Op::T, p.M, p.N, K, 1.0f, p.A, K, p.B, K, 0.0f, p.C, p.N, st);
    return;
  }
  std::vector<GroupedTile> tiles;
  int64_t total = 0;
  for (const GemmProblem& p : ps) {
    if (p.N > INT32_MAX) throw error("gemm", "grouped: N = ", p.N, " exceeds 32-bit sizes");
    const int mt = int((p.M + kGT - 1) / kGT), nt = int((p.N + kGT - 1) / kGT);
    tiles.push_back({p.A, p.B, p.C, int(p.M), int(p.N), nt, int(total)});
    total += int64_t(mt) * nt;
    if (total > INT32_MAX) throw error("gemm", "grouped: ", total, " tiles exceed the grid");
  }
  const device::Buffer d = device::upload_new(tiles.data(), tiles.size() * sizeof(GroupedTile));
  if (st == Storage::BF16)
    grouped_nt_kernel<__nv_bfloat16><<<unsigned(total), kGThreads, 0, device::stream()>>>(
        d.as<GroupedTile>(), int(tiles.size()), int(K));
  else
    grouped_nt_kernel<float><<<unsigned(total), kGThreads, 0, device::stream()>>>(d.as<GroupedTile>(),
                                                                                  int(tiles.size()), int(K));
  K3_CUDA_LAUNCHED();
}

void gemm_strided(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, int64_t sa,
                  const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc, int64_t sc,
                  int64_t count) {
  if (M == 0 || N == 0 || count == 0) return;
  device::require_cuda("gemm");
  for (int64_t v : {M, N, K, lda, ldb, ldc, count})
    if (v > INT32_MAX) throw error("gemm", "strided batch: size ", v, " exceeds the library's 32-bit sizes");
  Grouped& g = grouped();
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
