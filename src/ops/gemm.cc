#include "ops/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "core/device.h"
#include "ops/linear_blocks.h"
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
  if (is_block_dtype(w.dtype())) {
    if (layout != WeightLayout::OutIn || w.ndim() != 2 || w.dim(0) != out || w.dim(1) != in)
      throw error("linear", "a ", dtype_name(w.dtype()), " weight is [out, in]; got ", w.describe(), " for ", in,
                  " -> ", out);
    linear_blocks(x, M, in, out, w, y, beta);
  } else {
    const float* W = w.f32();
  if (layout == WeightLayout::OutIn)
    gemm(Trans::No, Trans::Yes, M, out, in, 1.0f, x, in, W, in, beta, y, out);
  else
    gemm(Trans::No, Trans::No, M, out, in, 1.0f, x, in, W, out, beta, y, out);
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out; ++o) y[m * out + o] += bias[o];
}

void linear_backward(const float* x, const float* dy, int64_t M, int64_t in, int64_t out, const Tensor& w,
                     WeightLayout layout, float* dx, float* dw, float* db) {
  if (is_block_dtype(w.dtype()))
    throw error("linear", "no gradient through a ", dtype_name(w.dtype()),
                " weight: training keeps fp32 weights (load the checkpoint without --quantize)");
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

namespace linear {

namespace {
float* host(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }
}  // namespace

void forward(const Tensor& x, const Tensor& w, const Tensor& b, WeightLayout layout, const Tensor& y, bool bf16) {
  if constexpr (device::kCudaBuilt)
    if (x.device() == Device::CUDA) return linear_cuda::forward(x, w, b, layout, y, bf16);
  const int64_t in = x.dim(-1), out = y.dim(-1);
  linear_forward(x.f32(), x.numel() / std::max<int64_t>(1, in), in, out, w, layout, host(b), y.f32());
}

void backward(const Tensor& x, const Tensor& w, WeightLayout layout, const Tensor& dy, const Tensor& dx,
              const Tensor& dw, const Tensor& db, bool bf16) {
  if constexpr (device::kCudaBuilt)
    if (x.device() == Device::CUDA) return linear_cuda::backward(x, w, layout, dy, dx, dw, db, bf16);
  const int64_t in = x.dim(-1), out = dy.dim(-1);
  linear_backward(x.f32(), dy.f32(), x.numel() / std::max<int64_t>(1, in), in, out, w, layout, host(dx), host(dw),
                  host(db));
}

std::vector<Tensor> grouped(const Tensor& x, const std::vector<const Tensor*>& weights) {
  if constexpr (device::kCudaBuilt)
    if (x.device() == Device::CUDA) return linear_cuda::grouped(x, weights);
  throw error("linear", "grouped projections of the host tensor ", x.describe(), " (a CUDA form only)");
}

}  // namespace linear

}  // namespace k3
