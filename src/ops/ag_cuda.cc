// The CUDA forms of the differentiable ops (ag_cuda.h): shape checks as in the CPU bodies, then
// the kernels of ops_cuda.h on k3's stream, and under Recording a backward closure that runs the
// backward kernels on the device and accumulates into the inputs' device gradients
// (Node::grad_cuda). Host index lists (token ids, positions, expert rows) are uploaded per call;
// they are small beside the activations, and the closures keep the uploaded copies.
#include "ops/ag_cuda.h"

#include <cmath>

#include "core/device.h"
#include "ops/ag_conv.h"
#include "ops/ops_cuda.h"

namespace k3::ag::gpu {

namespace {
int64_t last_dim(const Tensor& t) { return t.ndim() ? t.dim(-1) : 1; }
int64_t rows(const Tensor& t) { return t.numel() / std::max<int64_t>(1, last_dim(t)); }
float* out(const Tensor& t) { return t.cuda_f32(); }

using Ids = std::shared_ptr<device::Buffer>;
// refresh: how a replayed decode step's graph renews the ids (device.h); None where a step that
// uploads them cannot be replayed.
Ids upload_ids(const std::vector<int64_t>& v, device::Refresh refresh = device::Refresh::None) {
  return std::make_shared<device::Buffer>(device::upload_new(v.data(), v.size() * 8, refresh));
}

// The inputs' device gradients (null when an input needs none) and the output's.
float* grad(const Var& x) { return needs_grad(x) ? x->grad_cuda() : nullptr; }
const float* dy(Node& self) { return self.grad.cuda_f32(); }

}  // namespace

bool on_cuda(const Var& x) { return x && x->value.device() == Device::CUDA; }

namespace {
// An fp32 device array as a GEMM operand of storage `st` (a bf16 copy, or the array itself).
struct Operand {
  Tensor copy;
  const void* ptr;
  Operand(const float* x, int64_t n, device::Storage st) : ptr(x) {
    if (st == device::Storage::F32) return;
    copy = Tensor::empty_on(Device::CUDA, {n}, DType::BF16);
    cuda::cast(x, copy.raw(), n, st);
    ptr = copy.raw();
  }
};
}  // namespace


void forward_only(const char* op, const std::vector<Var>& inputs) {
  if (!recording()) return;
  for (const Var& v : inputs)
    if (needs_grad(v))
      throw error(op, "training through this op on CUDA is not supported yet (its CUDA form is forward-only)");
}

Tensor empty(Shape shape) { return Tensor::empty_on(Device::CUDA, std::move(shape)); }

Tensor zeros(Shape shape) {
  Tensor z = empty(std::move(shape));
  if (z.nbytes()) device::zero(z.raw(), z.nbytes());
  return z;
}

void flush(const Var& x, const Tensor& g) {
  if (x && needs_grad(x)) cuda::add_inplace(x->grad_cuda(), g.cuda_f32(), g.numel());
}

const float* in(const Var& x, const char* op) {
  if (!x) throw error(op, "missing input");
  if (x->value.device() != Device::CUDA)
    throw error(op, "input ", x->value.describe(), " is on the host while the op runs on CUDA");
  if (!x->value.is_contiguous()) throw error(op, "non-contiguous CUDA input ", x->value.describe());
  return x->value.cuda_f32();
}

std::vector<Tensor> linears_no_grad(const Tensor& x, const std::vector<const Tensor*>& weights) {
  K3_CHECK(!weights.empty() && x.device() == Device::CUDA && x.dtype() == DType::F32 && x.is_contiguous(),
           "linear: grouped projections of ", x.describe());
  const int64_t in_f = x.dim(-1), M = x.numel() / in_f;
  const DType wt = weights[0]->dtype();
  const device::Storage st = wt == DType::BF16 || bf16_gemms() ? device::Storage::BF16 : device::Storage::F32;
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
    ys.push_back(empty(ys_shape));
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

Var linear(const Var& x, const Var& w, const Var& b, WeightLayout layout) {
  const Tensor& W = w->value;
  const int64_t in_f = layout == WeightLayout::OutIn ? W.dim(1) : W.dim(0);
  const int64_t out_f = layout == WeightLayout::OutIn ? W.dim(0) : W.dim(1);
  const int64_t M = rows(x->value);  // shapes checked by ag::linear
  Shape ys = x->value.shape();
  ys.back() = out_f;
  Tensor y = empty(ys);
  const bool out_in = layout == WeightLayout::OutIn;
  const cuda::Op tb = out_in ? cuda::Op::T : cuda::Op::N;
  // bf16 operands (bf16 weights, or fp32 ones under Bf16Gemms), fp32 accumulation and output.
  const device::Storage st =
      W.dtype() == DType::BF16 || bf16_gemms() ? device::Storage::BF16 : device::Storage::F32;
  if (W.dtype() == DType::BF16) {
    if (W.device() != Device::CUDA) throw error("linear", "weight ", W.describe(), " is not on the device");
    const Operand xb(in(x, "linear"), M * in_f, st);
    cuda::gemm(cuda::Op::N, tb, M, out_f, in_f, 1.0f, xb.ptr, in_f, W.raw(), out_in ? in_f : out_f, 0.0f, out(y),
               out_f, st);
  } else {
    const Operand xb(in(x, "linear"), M * in_f, st), wb(in(w, "linear"), W.numel(), st);
    cuda::gemm(cuda::Op::N, tb, M, out_f, in_f, 1.0f, xb.ptr, in_f, wb.ptr, out_in ? in_f : out_f, 0.0f, out(y), out_f,
               st);
  }
  if (b) cuda::add_bias(out(y), in(b, "linear"), M, out_f);
  return make_node(std::move(y), {x, w, b}, [x, w, b, M, in_f, out_f, out_in, st](Node& self) {
    if (w->value.dtype() != DType::F32)
      throw error("linear", "training through bf16 weights on CUDA is not supported (keep fp32 master weights; "
                            "--dtype bf16 rounds the GEMM operands instead)");
    const Operand g(dy(self), M * out_f, st);
    if (needs_grad(x)) {  // dx += dy · W (OutIn) or dy · Wᵀ (InOut)
      const Operand wb(w->value.cuda_f32(), w->value.numel(), st);
      cuda::gemm(cuda::Op::N, out_in ? cuda::Op::N : cuda::Op::T, M, in_f, out_f, 1.0f, g.ptr, out_f, wb.ptr,
                 out_in ? in_f : out_f, 1.0f, x->grad_cuda(), in_f, st);
    }
    if (needs_grad(w)) {
      const Operand xb(x->value.cuda_f32(), M * in_f, st);
      if (out_in)  // dW[out, in] += dyᵀ · x
        cuda::gemm(cuda::Op::T, cuda::Op::N, out_f, in_f, M, 1.0f, g.ptr, out_f, xb.ptr, in_f, 1.0f, w->grad_cuda(),
                   in_f, st);
      else  // dW[in, out] += xᵀ · dy
        cuda::gemm(cuda::Op::T, cuda::Op::N, in_f, out_f, M, 1.0f, xb.ptr, in_f, g.ptr, out_f, 1.0f, w->grad_cuda(),
                   out_f, st);
    }
    if (needs_grad(b)) cuda::bias_grad(dy(self), b->grad_cuda(), M, out_f);
  }, "linear");
}

namespace {
// refresh: the rule of the ids' upload in a captured step (token ids, or positions).
Var embedding_of(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx,
                 device::Refresh refresh) {
  const int64_t D = table->value.dim(1), n = int64_t(ids.size());
  const int64_t vocab = table->value.dim(0);
  for (int64_t id : ids)  // checked here, so the kernel needs no flag read back
    if (id < 0 || id >= vocab) throw error("embedding", "token id ", id, " is outside the vocabulary [0, ", vocab, ")");
  Tensor y = empty({n, D});
  const Ids d_ids = upload_ids(ids, refresh);
  cuda::embedding_forward(in(table, "embedding"), vocab, d_ids->as<int64_t>(), n, D, out(y), device::Storage::F32,
                          /*check_ids=*/false);
  // The padding row gets no gradient (as on the CPU): the backward adds the other rows only.
  // The rows to skip matter to the backward only (and would be an upload a replayed step cannot
  // renew): none when nothing records.
  std::vector<int64_t> rows, kept;
  if (padding_idx && recording())
    for (int64_t i = 0; i < n; ++i)
      if (ids[size_t(i)] != *padding_idx) rows.push_back(i), kept.push_back(ids[size_t(i)]);
  const bool skip = padding_idx && recording() && int64_t(kept.size()) < n;
  const Ids d_rows = skip ? upload_ids(rows) : nullptr, d_kept = skip ? upload_ids(kept) : nullptr;
  const int64_t n_kept = skip ? int64_t(kept.size()) : n;
  return make_node(std::move(y), {table}, [table, d_ids, d_rows, d_kept, n_kept, D](Node& self) {
    if (!d_rows)
      return cuda::embedding_backward(d_ids->as<int64_t>(), n_kept, D, dy(self), table->grad_cuda(),
                                      device::Storage::F32);
    Tensor g = empty({n_kept, D});
    cuda::gather_rows(dy(self), d_rows->as<int64_t>(), n_kept, D, out(g));
    cuda::embedding_backward(d_kept->as<int64_t>(), n_kept, D, out(g), table->grad_cuda(), device::Storage::F32);
  }, "embedding");
}
}  // namespace

Var embedding(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx) {
  return embedding_of(table, ids, padding_idx, device::Refresh::Input);  // a replayed step's tokens
}
Var position_embedding(const Var& table, const std::vector<int64_t>& positions) {
  return embedding_of(table, positions, std::nullopt, device::Refresh::Advance);  // the next positions
}

Var causal_attention(const Var& q, const Var& k, const Var& v, int64_t B, int64_t T, int64_t H, float sc) {
  const int64_t D = last_dim(q->value), hd = D / H;
  const int64_t Dv = last_dim(v->value), hdv = Dv / H;
  K3_CHECK(rows(q->value) == B * T && D % H == 0 && Dv % H == 0 && last_dim(k->value) == D,
           "causal_attention: q ", q->value.describe(), " k ", k->value.describe(), " v ", v->value.describe(),
           " for B=", B, " T=", T, " H=", H);
  Tensor y = empty({B * T, Dv});
  const cuda::AttnShape a{B, T, T, H, hd, hdv, 0, sc};
  const bool train = recording();
  Tensor lse = train ? empty({B, H, T}) : Tensor();
  // Under Bf16Gemms attention's operands are bf16 too (autocast's split: its two products are
  // GEMMs), which runs the tensor-core kernels; softmax, lse and gradients stay fp32.
  const bool bf16 = bf16_gemms();
  const auto st = bf16 ? device::Storage::BF16 : device::Storage::F32;
  {
    const Operand qo(in(q, "attention"), q->value.numel(), st), ko(in(k, "attention"), k->value.numel(), st),
        vo(in(v, "attention"), v->value.numel(), st);
    Tensor yb = bf16 ? Tensor::empty_on(Device::CUDA, {B * T * Dv}, DType::BF16) : Tensor();
    cuda::attention_forward(qo.ptr, ko.ptr, vo.ptr, bf16 ? yb.raw() : out(y), train ? out(lse) : nullptr, a, st);
    if (bf16) cuda::widen(yb.raw(), out(y), y.numel(), st);
  }
  return make_node(std::move(y), {q, k, v}, [q, k, v, lse, a, st](Node& self) {
    // The kernel writes all three gradients: inputs that need none get scratch.
    auto target = [](const Var& x, Tensor& scratch) {
      if (needs_grad(x)) return x->grad_cuda();
      scratch = zeros(x->value.shape());
      return out(scratch);
    };
    Tensor sq, sk, sv;
    float *dq = target(q, sq), *dk = target(k, sk), *dv = target(v, sv);
    // y went through bf16 on the way out, so its bf16 copy here is the one the forward wrote.
    const Operand qo(q->value.cuda_f32(), q->value.numel(), st), ko(k->value.cuda_f32(), k->value.numel(), st),
        vo(v->value.cuda_f32(), v->value.numel(), st), yo(self.value.cuda_f32(), self.value.numel(), st),
        dyo(dy(self), self.value.numel(), st);
    cuda::attention_backward(qo.ptr, ko.ptr, vo.ptr, yo.ptr, lse.cuda_f32(), dyo.ptr, dq, dk, dv, a, st);
  }, "attention");
}

Var rope(const Var& x, const std::vector<int64_t>& positions, int64_t H, int64_t offset, const RopeTable& table) {
  const int64_t M = rows(x->value), hd = last_dim(x->value) / H;
  K3_CHECK(int64_t(positions.size()) == M && offset + table.dim <= hd, "rope: ", x->value.describe(), " H=", H);
  Tensor y = x->value.clone();
  const Ids pos = upload_ids(positions, device::Refresh::Advance);  // a replayed step's are the next ones
  const Ids inv = std::make_shared<device::Buffer>(
      device::upload_new(table.inv_freq.data(), table.inv_freq.size() * sizeof(double), device::Refresh::Constant));
  cuda::rope_apply(out(y), M, H, hd, offset, table.dim, pos->as<int64_t>(), inv->as<double>(), table.attention_factor,
                   +1, device::Storage::F32);
  const int64_t rot = table.dim;
  const double factor = table.attention_factor;
  return make_node(std::move(y), {x}, [x, pos, inv, M, H, hd, offset, rot, factor](Node& self) {
    Tensor g = self.grad.clone();  // the inverse rotation of the gradient
    cuda::rope_apply(out(g), M, H, hd, offset, rot, pos->as<int64_t>(), inv->as<double>(), factor, -1,
                     device::Storage::F32);
    flush(x, g);
  }, "rope");
}

Var weighted_combine(const std::vector<Var>& ys, const Dispatch& d, const Var& w, int64_t M) {
  K3_CHECK(static_cast<int64_t>(ys.size()) == d.active(), "weighted_combine: ", ys.size(), " outputs for ", d.active(),
           " experts");
  const int64_t N = ys.empty() ? 0 : last_dim(ys[0]->value);
  for (size_t j = 0; j < ys.size(); ++j)
    K3_CHECK(last_dim(ys[j]->value) == N && rows(ys[j]->value) == d.offsets[j + 1] - d.offsets[j],
             "weighted_combine: expert output ", ys[j]->value.describe());
  Tensor o = empty({M, N});
  if (o.numel()) device::zero(o.raw(), o.nbytes());
  const Ids d_rows = upload_ids(d.rows), d_slots = upload_ids(d.slots);
  for (size_t j = 0; j < ys.size(); ++j) {
    const int64_t p0 = d.offsets[j], n = d.offsets[j + 1] - p0;
    cuda::scatter_weighted(in(ys[j], "weighted_combine"), d_rows->as<int64_t>() + p0, d_slots->as<int64_t>() + p0,
                           in(w, "weighted_combine"), n, N, out(o));
  }
  std::vector<Var> parents = ys;
  parents.push_back(w);
  const std::vector<int64_t> offsets = d.offsets;
  return make_node(std::move(o), std::move(parents), [ys, w, d_rows, d_slots, offsets, N](Node& self) {
    float* dw = grad(w);
    for (size_t j = 0; j < ys.size(); ++j) {
      const int64_t p0 = offsets[j], n = offsets[j + 1] - p0;
      cuda::scatter_weighted_backward(dy(self), ys[j]->value.cuda_f32(), d_rows->as<int64_t>() + p0,
                                      d_slots->as<int64_t>() + p0, w->value.cuda_f32(), n, N, grad(ys[j]), dw);
    }
  }, "weighted_combine");
}

Var cross_entropy_head(const Var& h, const Var& w, const std::vector<int64_t>& targets, float z_loss) {
  const int64_t N = h->value.dim(0), V = w->value.dim(0);
  K3_CHECK(int64_t(targets.size()) == N, "cross_entropy: ", targets.size(), " targets for ", N, " rows");
  int64_t count = 0;
  for (int64_t t : targets) {
    if (t >= V) throw error("cross_entropy", "target id ", t, " outside the vocabulary of ", V);
    count += t >= 0;
  }
  in(h, "cross_entropy");
  const Ids d_tgt = upload_ids(targets);
  Tensor loss = empty({N});
  // Rows per chunk: at most 64 MiB of logits at a time.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(16) << 20) / std::max<int64_t>(1, V)));
  const bool bf16 = bf16_gemms();
  auto logits_of = [h, w, bf16](int64_t r0, int64_t n) {  // [n, V] fp32, computed the forward's way
    NoRecording off;
    const bool saved = bf16_gemms();
    set_bf16_gemms(bf16);
    Var z = gpu::linear(constant(h->value.slice(0, r0, r0 + n)), w, nullptr, WeightLayout::OutIn);
    set_bf16_gemms(saved);
    return z;
  };
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const Var logits = logits_of(r0, n);
    cuda::cross_entropy(out(logits->value), d_tgt->as<int64_t>() + r0, n, V, out(loss) + r0, nullptr, 1.0f, z_loss);
  }
  const Tensor host = loss.to_device(Device::CPU);
  double sum = 0;
  for (int64_t i = 0; i < N; ++i)
    if (targets[size_t(i)] >= 0) sum += host.f32()[i];
  // The loss is a host scalar; its backward recomputes each chunk's logits, turns them into
  // dlogits in place and runs the two GEMMs of the head.
  return make_node(Tensor::full({1}, count ? float(sum / double(count)) : 0.0f), {h, w},
                   [h, w, d_tgt, logits_of, N, V, chunk, count, z_loss, bf16](Node& self) {
    if (w->value.dtype() != DType::F32)
      throw error("cross_entropy", "training through a bf16 head on CUDA is not supported (keep fp32 master weights; "
                                   "--dtype bf16 rounds the GEMM operands instead)");
    const float g = self.grad.to_device(Device::CPU).f32()[0] / float(std::max<int64_t>(count, 1));
    const int64_t D = h->value.dim(1);
    const device::Storage st = bf16 ? device::Storage::BF16 : device::Storage::F32;
    const Operand wb(w->value.cuda_f32(), w->value.numel(), st);
    Tensor scratch = empty({chunk});
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const Var logits = logits_of(r0, n);
      float* dz = out(logits->value);
      cuda::cross_entropy(dz, d_tgt->as<int64_t>() + r0, n, V, out(scratch), dz, g, z_loss);
      const Operand dzb(dz, n * V, st);
      if (needs_grad(h))  // dh[r0 : r0 + n] += dz · W
        cuda::gemm(cuda::Op::N, cuda::Op::N, n, D, V, 1.0f, dzb.ptr, V, wb.ptr, D, 1.0f, h->grad_cuda() + r0 * D, D,
                   st);
      if (needs_grad(w)) {  // dW += dzᵀ · h[r0 : r0 + n]
        const Operand hb(h->value.cuda_f32() + r0 * D, n * D, st);
        cuda::gemm(cuda::Op::T, cuda::Op::N, V, D, n, 1.0f, dzb.ptr, V, hb.ptr, D, 1.0f, w->grad_cuda(), D, st);
      }
    }
  }, "cross_entropy");
}

}  // namespace k3::ag::gpu
