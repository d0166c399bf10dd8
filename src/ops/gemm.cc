#include "ops/gemm.h"

#include <cblas.h>

#include "core/device.h"
#include "ops/ops_cuda.h"

namespace k3 {

void set_device_gemm_tuning(bool on) {
  if constexpr (device::kCudaBuilt) cuda::set_gemm_tuning(on);
}

void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (lda == 0) lda = ta == Trans::No ? K : M;
  if (ldb == 0) ldb = tb == Trans::No ? N : K;
  if (ldc == 0) ldc = N;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (M == 1 && ta == Trans::No) {
    // Vector-matrix product: gemv streams the weight once, the decode hot path.
    // y[N] = alpha op(B)ᵀ-shaped product: y = x[K] · op(B)[K,N]
    if (tb == Trans::Yes)  // B is [N,K]: y = B x
      cblas_sgemv(CblasRowMajor, CblasNoTrans, blasint(N), blasint(K), alpha, B, blasint(ldb), A, 1, beta, C, 1);
    else  // B is [K,N]: y = Bᵀ x
      cblas_sgemv(CblasRowMajor, CblasTrans, blasint(K), blasint(N), alpha, B, blasint(ldb), A, 1, beta, C, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta == Trans::Yes ? CblasTrans : CblasNoTrans, tb == Trans::Yes ? CblasTrans : CblasNoTrans,
              blasint(M), blasint(N), blasint(K), alpha, A, blasint(lda), B, blasint(ldb), beta, C, blasint(ldc));
}

void linear_forward(const float* x, int64_t M, int64_t in, int64_t out, const Tensor& w, WeightLayout layout,
                    const float* bias, float* y, float beta) {
  const float* W = w.f32();
  if (layout == WeightLayout::OutIn)
    gemm(Trans::No, Trans::Yes, M, out, in, 1.0f, x, in, W, in, beta, y, out);
  else
    gemm(Trans::No, Trans::No, M, out, in, 1.0f, x, in, W, out, beta, y, out);
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out; ++o) y[m * out + o] += bias[o];
}

void linear_backward(const float* x, const float* dy, int64_t M, int64_t in, int64_t out, const Tensor& w,
                     WeightLayout layout, float* dx, float* dw, float* db) {
  const float* W = w.f32();
  if (dx) {
    if (layout == WeightLayout::OutIn)  // dx[M,in] += dy[M,out] W[out,in]
      gemm(Trans::No, Trans::No, M, in, out, 1.0f, dy, out, W, in, 1.0f, dx, in);
    else  // W[in,out]: dx += dy Wᵀ
      gemm(Trans::No, Trans::Yes, M, in, out, 1.0f, dy, out, W, out, 1.0f, dx, in);
  }
  if (dw) {
    if (layout == WeightLayout::OutIn)  // dW[out,in] += dyᵀ x
      gemm(Trans::Yes, Trans::No, out, in, M, 1.0f, dy, out, x, in, 1.0f, dw, in);
    else  // dW[in,out] += xᵀ dy
      gemm(Trans::Yes, Trans::No, in, out, M, 1.0f, x, in, dy, out, 1.0f, dw, out);
  }
  if (db)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out; ++o) db[o] += dy[m * out + o];
}

}  // namespace k3
