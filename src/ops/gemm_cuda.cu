// Row-major GEMM through cuBLASLt: fp32 (no TF32: CUBLAS_COMPUTE_32F) and bf16 operands with fp32
// accumulation and fp32 output. cuBLASLt is column-major, so the row-major C = op(A) op(B) is
// computed as the column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage is Lt's first operand.
#include <cublasLt.h>

#include <mutex>

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

void gemm(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
          int64_t ldb, float beta, float* C, int64_t ldc, Storage st) {
  if (M == 0 || N == 0) return;
  device::require_cuda("gemm");
  const int64_t a_cols = ta == Op::N ? K : M;  // row-major A is [M, K] or [K, M]
  const int64_t b_cols = tb == Op::N ? N : K;
  if (lda == 0) lda = a_cols;
  if (ldb == 0) ldb = b_cols;
  if (ldc == 0) ldc = N;
  const cudaDataType_t in = st == Storage::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  Lt& l = lt();
  cublasLtMatmulDesc_t op = nullptr;
  lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // Lt's first operand is B's storage (col-major [b_cols, rows]); transposed iff tb == T.
  const cublasOperation_t opa = tb == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = ta == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "set TRANSB");
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  // Stored col-major shapes: B as [b_cols, b_rows], A as [a_cols, a_rows], C as [N, M].
  const int64_t b_rows = tb == Op::N ? K : N, a_rows = ta == Op::N ? M : K;
  lt_check(cublasLtMatrixLayoutCreate(&la, in, uint64_t(b_cols), uint64_t(b_rows), ldb), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&lb, in, uint64_t(a_cols), uint64_t(a_rows), lda), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, uint64_t(N), uint64_t(M), ldc), "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t ws = l.workspace.bytes();
  lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "workspace preference");
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(l.handle, op, la, lb, lc, lc, pref, 1, &heur, &found), "heuristic");
  if (found == 0) throw error("cublas", "no cuBLASLt algorithm for a ", M, "x", N, "x", K, " GEMM");
  lt_check(cublasLtMatmul(l.handle, op, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &heur.algo, l.workspace.get(), ws,
                          device::stream()),
           "cublasLtMatmul");
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace k3::cuda
