// The linear layer's CUDA form (ops/gemm.h): cuBLASLt GEMMs on k3's stream, fp32 or bf16 operands
// (bf16 weights, or fp32 ones rounded under Bf16Gemms) with fp32 accumulation and output.
#include <algorithm>

#include "ops/gemm.h"
#include "ops/operand_cuda.h"
#include "ops/precision.h"

namespace k3::linear_cuda {

using cuda::Operand;

namespace {
const float* dev_in(const Tensor& t, const char* what) {
  if (t.device() != Device::CUDA) throw error("linear", what, " ", t.describe(), " is not on the device");
  if (!t.is_contiguous()) throw error("linear", "non-contiguous ", what, " ", t.describe());
  return t.cuda_f32();
}
}  // namespace

namespace {
// x · Wᵀ for a block-format W [out, in]: streamed packed for a few rows, else through a bf16 copy.
void forward_blocks(const Tensor& x, const Tensor& w, const Tensor& b, WeightLayout layout, const Tensor& y) {
  if (layout != WeightLayout::OutIn || w.ndim() != 2 || x.dim(-1) != w.dim(1))
    throw error("linear", "a ", dtype_name(w.dtype()), " weight is [out, in]; got ", w.describe(), " for input ",
                x.describe());
  if (w.device() != Device::CUDA) throw error("linear", "weight ", w.describe(), " is not on the device");
  const int64_t in_f = w.dim(1), out_f = w.dim(0), M = x.numel() / std::max<int64_t>(1, in_f);
  const float* bias = b.defined() ? dev_in(b, "bias") : nullptr;
  if (M <= cuda::kGemvMaxRows) {
    if (M) cuda::gemv_blocks(w.dtype(), dev_in(x, "input"), M, w.raw(), in_f, out_f, bias, y.cuda_f32(), 0.0f);
    return;
  }
  const Tensor wb = Tensor::empty_on(Device::CUDA, {out_f, in_f}, DType::BF16);
  cuda::dequantize_to_bf16(w.dtype(), w.raw(), w.numel(), wb.raw());
  const Operand xb(dev_in(x, "input"), M * in_f, device::Storage::BF16);
  cuda::gemm(cuda::Op::N, cuda::Op::T, M, out_f, in_f, 1.0f, xb.ptr, in_f, wb.raw(), in_f, 0.0f, y.cuda_f32(), out_f,
             device::Storage::BF16, bias);
}
}  // namespace

void forward(const Tensor& x, const Tensor& w, const Tensor& b, WeightLayout layout, const Tensor& y, bool bf16) {
  if (is_block_dtype(w.dtype())) return forward_blocks(x, w, b, layout, y);
  const bool out_in = layout == WeightLayout::OutIn;
  const int64_t in_f = out_in ? w.dim(1) : w.dim(0), out_f = out_in ? w.dim(0) : w.dim(1);
  const int64_t M = x.numel() / std::max<int64_t>(1, in_f);
  const cuda::Op tb = out_in ? cuda::Op::T : cuda::Op::N;
  const device::Storage st = cuda::gemm_storage(w.dtype() == DType::BF16 || bf16);
  const Operand xb(dev_in(x, "input"), M * in_f, st);
  const void* wp = nullptr;
  Operand wb(nullptr, 0, device::Storage::F32);
  if (w.dtype() == DType::BF16) {
    if (w.device() != Device::CUDA) throw error("linear", "weight ", w.describe(), " is not on the device");
    wp = w.raw();
  } else {
    wb = Operand(dev_in(w, "weight"), w.numel(), st);
    wp = wb.ptr;
  }
  cuda::gemm(cuda::Op::N, tb, M, out_f, in_f, 1.0f, xb.ptr, in_f, wp, out_in ? in_f : out_f, 0.0f, y.cuda_f32(), out_f,
             st);
  if (b.defined()) cuda::add_bias(y.cuda_f32(), dev_in(b, "bias"), M, out_f);
}

void backward(const Tensor& x, const Tensor& w, WeightLayout layout, const Tensor& dy, const Tensor& dx,
              const Tensor& dw, const Tensor& db, bool bf16) {
  if (is_block_dtype(w.dtype()))
    throw error("linear", "no gradient through a ", dtype_name(w.dtype()),
                " weight: training keeps fp32 weights (load the checkpoint without --quantize)");
  if (w.dtype() != DType::F32)
    throw error("linear", "training through bf16 weights on CUDA is not supported (keep fp32 master weights; "
                          "--dtype bf16 rounds the GEMM operands instead)");
  const bool out_in = layout == WeightLayout::OutIn;
  const int64_t in_f = out_in ? w.dim(1) : w.dim(0), out_f = out_in ? w.dim(0) : w.dim(1);
  const int64_t M = x.numel() / std::max<int64_t>(1, in_f);
  const device::Storage st = cuda::gemm_storage(bf16);
  const Operand g(dy.cuda_f32(), M * out_f, st);
  if (dx.defined()) {  // dx += dy · W (OutIn) or dy · Wᵀ (InOut)
    const Operand wb(w.cuda_f32(), w.numel(), st);
    cuda::gemm(cuda::Op::N, out_in ? cuda::Op::N : cuda::Op::T, M, in_f, out_f, 1.0f, g.ptr, out_f, wb.ptr,
               out_in ? in_f : out_f, 1.0f, dx.cuda_f32(), in_f, st);
  }
  if (dw.defined()) {
    const Operand xb(x.cuda_f32(), M * in_f, st);
    if (out_in)  // dW[out, in] += dyᵀ · x
      cuda::gemm(cuda::Op::T, cuda::Op::N, out_f, in_f, M, 1.0f, g.ptr, out_f, xb.ptr, in_f, 1.0f, dw.cuda_f32(), in_f,
                 st);
    else  // dW[in, out] += xᵀ · dy
      cuda::gemm(cuda::Op::T, cuda::Op::N, in_f, out_f, M, 1.0f, xb.ptr, in_f, g.ptr, out_f, 1.0f, dw.cuda_f32(), out_f,
                 st);
  }
  if (db.defined()) cuda::bias_grad(dy.cuda_f32(), db.cuda_f32(), M, out_f);
}

std::vector<Tensor> grouped(const Tensor& x, const std::vector<const Tensor*>& weights) {
  K3_CHECK(!weights.empty() && x.dtype() == DType::F32 && x.is_contiguous(), "linear: grouped projections of ",
           x.describe());
  const int64_t in_f = x.dim(-1), M = x.numel() / in_f;
  const DType wt = weights[0]->dtype();
  const device::Storage st = cuda::gemm_storage(wt == DType::BF16 || ag::gpu::bf16_gemms());
  std::vector<Tensor> ys;
  std::vector<cuda::GemmProblem> ps;
  const Operand xb(x.cuda_f32(), M * in_f, st);
  std::vector<Operand> wbs;  // fp32 weights rounded for bf16 GEMMs, kept until the call
  wbs.reserve(weights.size());
  for (const Tensor* w : weights) {
    K3_CHECK(w->device() == Device::CUDA && w->ndim() == 2 && w->dim(1) == in_f && w->dtype() == wt,
             "linear: grouped weight ", w->describe(), " for ", in_f, " inputs of ", dtype_name(wt));
    Shape ys_shape = x.shape();
    ys_shape.back() = w->dim(0);
    ys.push_back(Tensor::empty_on(Device::CUDA, ys_shape));
    const void* wp = w->raw();
    if (wt == DType::F32) {
      wbs.emplace_back(w->cuda_f32(), w->numel(), st);
      wp = wbs.back().ptr;
    }
    ps.push_back({M, xb.ptr, wp, ys.back().cuda_f32(), w->dim(0)});
  }
  cuda::gemm_nt_grouped(0, in_f, ps, st);
  return ys;
}

}  // namespace k3::linear_cuda
