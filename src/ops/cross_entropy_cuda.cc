// The cross-entropy's CUDA form (ops/cross_entropy.h): row chunks of logits from the linear's
// GEMM, the loss kernel per chunk; the backward recomputes each chunk's logits, turns them into
// dlogits in place and runs the head's two GEMMs. The summed loss comes back to the host.
#include <algorithm>

#include "ops/cross_entropy.h"
#include "ops/gemm.h"
#include "ops/operand_cuda.h"

namespace k3::cross_entropy_cuda {

namespace {
// Rows per chunk: at most 64 MiB of fp32 logits at a time.
int64_t chunk_rows(int64_t N, int64_t V) {
  return std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(16) << 20) / std::max<int64_t>(1, V)));
}
// [n, V] fp32 logits of rows [r0, r0 + n), computed the forward's way.
Tensor logits_of(const Tensor& h, const Tensor& w, int64_t r0, int64_t n, bool bf16) {
  Tensor z = Tensor::empty_on(Device::CUDA, {n, w.dim(0)});
  linear_cuda::forward(h.slice(0, r0, r0 + n), w, Tensor(), WeightLayout::OutIn, z, bf16);
  return z;
}
}  // namespace

double forward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, float z_loss, bool bf16,
               cross_entropy::Saved& saved) {
  if (!h.is_contiguous()) throw error("cross_entropy", "non-contiguous CUDA input ", h.describe());
  const int64_t N = h.dim(0), V = w.dim(0), chunk = chunk_rows(N, V);
  saved.targets = upload_ids(targets);
  Tensor loss = Tensor::empty_on(Device::CUDA, {N});
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const Tensor z = logits_of(h, w, r0, n, bf16);
    cuda::cross_entropy(z.cuda_f32(), saved.targets->as<int64_t>() + r0, n, V, loss.cuda_f32() + r0, nullptr, 1.0f,
                        z_loss);
  }
  const Tensor host = loss.to_device(Device::CPU);
  double sum = 0;
  for (int64_t i = 0; i < N; ++i)
    if (targets[size_t(i)] >= 0) sum += host.f32()[i];
  return sum;
}

void backward(const Tensor& h, const Tensor& w, float z_loss, bool bf16, const cross_entropy::Saved& saved, float g,
              const Tensor& dh, const Tensor& dw) {
  if (w.dtype() != DType::F32)
    throw error("cross_entropy", "training through a bf16 head on CUDA is not supported (keep fp32 master weights; "
                                 "--dtype bf16 rounds the GEMM operands instead)");
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0), chunk = chunk_rows(N, V);
  const device::Storage st = cuda::gemm_storage(bf16);
  const cuda::Operand wb(w.cuda_f32(), w.numel(), st);
  Tensor scratch = Tensor::empty_on(Device::CUDA, {chunk});
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const Tensor z = logits_of(h, w, r0, n, bf16);
    float* dz = z.cuda_f32();
    cuda::cross_entropy(dz, saved.targets->as<int64_t>() + r0, n, V, scratch.cuda_f32(), dz, g, z_loss);
    const cuda::Operand dzb(dz, n * V, st);
    if (dh.defined())  // dh[r0 : r0 + n] += dz · W
      cuda::gemm(cuda::Op::N, cuda::Op::N, n, D, V, 1.0f, dzb.ptr, V, wb.ptr, D, 1.0f, dh.cuda_f32() + r0 * D, D, st);
    if (dw.defined()) {  // dW += dzᵀ · h[r0 : r0 + n]
      const cuda::Operand hb(h.cuda_f32() + r0 * D, n * D, st);
      cuda::gemm(cuda::Op::T, cuda::Op::N, V, D, n, 1.0f, dzb.ptr, V, hb.ptr, D, 1.0f, dw.cuda_f32(), D, st);
    }
  }
}

}  // namespace k3::cross_entropy_cuda
