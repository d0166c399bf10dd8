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
  bool unsupported[2] = {false, false};  // per Storage: the library refused the type combination
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

void gemm_nt_grouped(int64_t N, int64_t K, const std::vector<GemmProblem>& problems, Storage st) {
  std::vector<GemmProblem> ps;
  for (GemmProblem p : problems) {
    if (p.N <= 0) p.N = N;
    if (p.M > 0 && p.N > 0) ps.push_back(p);
  }
  if (ps.empty()) return;
  device::require_cuda("gemm");
  Grouped& g = grouped();
  std::lock_guard<std::mutex> lock(g.mu);
  if (!g.unsupported[int(st)]) {
    const int G = int(ps.size());
    // Column-major view: C_iᵀ [N, M_i] = B_i [N, K] (stored as col-major [K, N], transposed) · A_iᵀ.
    const size_t g_n = static_cast<size_t>(G);
    const int n_in = static_cast<int>(K);
    std::vector<cublasOperation_t> ta(g_n, CUBLAS_OP_T), tb(g_n, CUBLAS_OP_N);
    std::vector<int> m(g_n, 0), n(g_n, 0), k(g_n, n_in), lda(g_n, n_in), ldb(g_n, n_in), ldc(g_n, 0), sizes(g_n, 1);
    std::vector<float> alpha(g_n, 1.0f), beta(g_n, 0.0f);
    std::vector<const void*> ptrs(3 * g_n);
    for (int i = 0; i < G; ++i) {
      n[size_t(i)] = int(ps[size_t(i)].M);
      m[size_t(i)] = ldc[size_t(i)] = int(ps[size_t(i)].N);
      ptrs[size_t(i)] = ps[size_t(i)].B;
      ptrs[size_t(G + i)] = ps[size_t(i)].A;
      ptrs[size_t(2 * G + i)] = ps[size_t(i)].C;
    }
    const device::Buffer d_ptrs = device::upload_new(ptrs.data(), ptrs.size() * sizeof(void*));
    const auto* dp = d_ptrs.as<const void*>();
    const cudaDataType_t in = st == Storage::BF16 ? CUDA_R_16BF : CUDA_R_32F;
    lt_check(cublasSetStream(g.handle, device::stream()), "cublasSetStream");
    const cublasStatus_t s = cublasGemmGroupedBatchedEx(
        g.handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), dp, in, lda.data(), dp + G, in,
        ldb.data(), beta.data(), const_cast<void* const*>(dp + 2 * G), CUDA_R_32F, ldc.data(), G, sizes.data(),
        CUBLAS_COMPUTE_32F);
    if (s == CUBLAS_STATUS_SUCCESS) return;
    if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE)
      lt_check(s, "cublasGemmGroupedBatchedEx");
    g.unsupported[int(st)] = true;  // this type combination: one GEMM per problem from now on
  }
  for (const GemmProblem& p : ps) gemm(Op::N, Op::T, p.M, p.N, K, 1.0f, p.A, K, p.B, K, 0.0f, p.C, p.N, st);
}

bool gemm_grouped_available(Storage st) {
  Grouped& g = grouped();
  std::lock_guard<std::mutex> lock(g.mu);
  return !g.unsupported[int(st)];
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
