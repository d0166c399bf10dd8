#include "ops/ag.h"

#include "ops/precision.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/parallel.h"
#include "core/fastmath.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/blocks.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/norm.h"
#if defined(K3_HAS_CUDA)
#include "ops/device_ids.h"
#include "ops/operand_cuda.h"
#endif

namespace k3::ag {

namespace {
int64_t last_dim(const Tensor& t) { return t.ndim() ? t.dim(-1) : 1; }
int64_t rows(const Tensor& t) { return t.numel() / std::max<int64_t>(1, last_dim(t)); }
// x's gradient to accumulate into, or none where x needs none.
Tensor grad_if_needed(const Var& x) { return needs_grad(x) ? x->grad_tensor() : Tensor(); }
void same_shape(const Var& a, const Var& b, const char* op) {
  if (a->value.shape() != b->value.shape())
    throw error(op, "shapes differ: ", a->value.describe(), " vs ", b->value.describe());
}
}  // namespace

Var linear(const Var& x, const Var& w, const Var& b, WeightLayout layout) {
  const Tensor& W = w->value;
  const int64_t in = layout == WeightLayout::OutIn ? W.dim(1) : W.dim(0);
  const int64_t out = layout == WeightLayout::OutIn ? W.dim(0) : W.dim(1);
  if (last_dim(x->value) != in)
    throw error("linear", "input ", x->value.describe(), " does not match weight ", W.describe());
  Shape ys = x->value.shape();
  ys.back() = out;
  Tensor y = Tensor::empty_on(x->value.device(), ys);
  const bool bf16 = gpu::bf16_gemms();  // the backward rounds its operands as the forward did
  linear::forward(x->value, W, b ? b->value : Tensor(), layout, y, bf16);
  return make_node(std::move(y), {x, w, b}, [x, w, b, layout, bf16](Node& self) {
    linear::backward(x->value, w->value, layout, self.grad, grad_if_needed(x), grad_if_needed(w), grad_if_needed(b),
                     bf16);
  }, "linear");
}

namespace {
Tensor like_on_device(const Tensor& t) { return Tensor::empty_on(t.device(), t.shape()); }

// y = f(a) and its backward, on a's device (ops/elementwise.h).
Var unary(const Var& a, elementwise::Unary f, float s = 1.0f) {
  Tensor y = like_on_device(a->value);
  elementwise::unary(f, a->value, y, s);
  return make_node(std::move(y), {a}, [a, f, s](Node& self) {
    elementwise::unary_backward(f, a->value, self.grad, a->grad_tensor(), s);
  }, elementwise::name(f));
}
}  // namespace

Var add(const Var& a, const Var& b) {
  same_shape(a, b, "add");
  Tensor y = like_on_device(a->value);
  elementwise::add(a->value, b->value, y);
  return make_node(std::move(y), {a, b}, [a, b](Node& self) {
    if (needs_grad(a)) elementwise::accumulate(a->grad_tensor(), self.grad);
    if (needs_grad(b)) elementwise::accumulate(b->grad_tensor(), self.grad);
  }, "add");
}

Var sub(const Var& a, const Var& b) { return add(a, scale(b, -1.0f)); }

Var mul(const Var& a, const Var& b) {
  same_shape(a, b, "mul");
  Tensor y = like_on_device(a->value);
  elementwise::mul(a->value, b->value, y);
  return make_node(std::move(y), {a, b}, [a, b](Node& self) {
    elementwise::mul_backward(a->value, b->value, self.grad, grad_if_needed(a), grad_if_needed(b));
  }, "mul");
}

Var scale(const Var& a, float s) { return unary(a, elementwise::Unary::Scale, s); }
Var sigmoid(const Var& a) { return unary(a, elementwise::Unary::Sigmoid); }
Var silu(const Var& a) { return unary(a, elementwise::Unary::Silu); }
Var elu1(const Var& a) { return unary(a, elementwise::Unary::Elu1); }
Var gelu_tanh(const Var& a) { return unary(a, elementwise::Unary::GeluTanh); }

Var layernorm(const Var& x, const Var& w, const Var& b, float eps) {
  const int64_t M = rows(x->value);
  Tensor y = like_on_device(x->value);
  const Tensor stats = recording() ? Tensor::empty_on(x->value.device(), {2, M}) : Tensor();  // mean, rstd
  norm::layernorm(x->value, w->value, b ? b->value : Tensor(), eps, y, stats);
  return make_node(std::move(y), {x, w, b}, [x, w, b, stats](Node& self) {
    norm::layernorm_backward(x->value, w->value, stats, self.grad, grad_if_needed(x), grad_if_needed(w),
                             grad_if_needed(b));
  }, "layernorm");
}

Var rmsnorm(const Var& x, const Var& w, float eps) {
  const int64_t M = rows(x->value);
  Tensor y = like_on_device(x->value);
  const Tensor rstd = recording() ? Tensor::empty_on(x->value.device(), {M}) : Tensor();
  norm::rmsnorm(x->value, w ? w->value : Tensor(), eps, y, rstd);
  return make_node(std::move(y), {x, w}, [x, w, rstd, eps](Node& self) {
    norm::rmsnorm_backward(x->value, w ? w->value : Tensor(), rstd, eps, self.grad, grad_if_needed(x),
                           grad_if_needed(w));
  }, "rmsnorm");
}

namespace {
// refresh: how a replayed step's graph renews the uploaded ids on CUDA (token ids, or the next
// positions). The padding row gets no gradient: the backward's ids mark its rows with -1, which
// the scatter-add skips.
Var embedding_of(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx,
                 device::Refresh refresh) {
  const int64_t vocab = table->value.dim(0), D = table->value.dim(1), n = int64_t(ids.size());
  for (int64_t i = 0; i < n; ++i)  // checked here, so the kernel needs no flag read back
    if (ids[size_t(i)] < 0 || ids[size_t(i)] >= vocab)
      throw error("embedding", "token id ", ids[size_t(i)], " at position ", i, " is outside the vocabulary [0, ",
                  vocab, ")");
  const bool cuda = table->value.device() == Device::CUDA;
  Tensor y = Tensor::empty_on(table->value.device(), {n, D});
  DeviceIds d_ids;
  if (cuda) {
#if defined(K3_HAS_CUDA)
    d_ids = upload_ids(ids, refresh);
    cuda::embedding_forward(table->value.cuda_f32(), vocab, d_ids->as<int64_t>(), n, D, y.cuda_f32(),
                            device::Storage::F32, /*check_ids=*/false);
#endif
  } else {
    embedding_forward(table->value, ids.data(), n, y.f32());
  }
  // The backward's ids: the padding rows marked (only when something records: an upload a replayed
  // step could not renew).
  std::vector<int64_t> back = ids;
  bool marked = false;
  if (padding_idx && recording())
    for (int64_t& id : back)
      if (id == *padding_idx) id = -1, marked = true;
  const DeviceIds d_back = cuda && marked ? upload_ids(back) : d_ids;
  return make_node(std::move(y), {table}, [table, back, d_back, n, D](Node& self) {
    if (d_back) {
#if defined(K3_HAS_CUDA)
      return cuda::embedding_backward(d_back->as<int64_t>(), n, D, self.grad.cuda_f32(), table->grad_cuda(),
                                      device::Storage::F32);
#endif
    }
    embedding_backward(back.data(), n, D, self.grad.f32(), table->grad_f32());
  }, "embedding");
}
}  // namespace

Var embedding(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx) {
  return embedding_of(table, ids, padding_idx, device::Refresh::Input);  // a replayed step's tokens
}

Var position_embedding(const Var& table, const std::vector<int64_t>& positions) {
  return embedding_of(table, positions, std::nullopt, device::Refresh::Advance);  // the next positions
}

Var reshape(const Var& x, Shape shape) {
  Tensor y = x->value.reshape(std::move(shape));
  return make_node(std::move(y), {x}, [x](Node& self) {
    elementwise::accumulate(x->grad_tensor(), self.grad);
  }, "reshape");
}

Var slice_last(const Var& x, int64_t begin, int64_t end) {
  const int64_t N = last_dim(x->value), M = rows(x->value), n = end - begin;
  K3_CHECK(0 <= begin && begin <= end && end <= N, "slice_last [", begin, ", ", end, ") of ", x->value.describe());
  Shape s = x->value.shape();
  s.back() = n;
  Tensor y = Tensor::empty_on(x->value.device(), s);
  blocks::copy_blocks(x->value, {begin, N, 0}, y, {0, n, 0}, M, 1, n);
  return make_node(std::move(y), {x}, [x, begin, n, N, M](Node& self) {
    blocks::add_blocks(self.grad, {0, n, 0}, x->grad_tensor(), {begin, N, 0}, M, 1, n);
  }, "slice");
}

Var concat_last(const std::vector<Var>& xs) {
  K3_CHECK(!xs.empty(), "concat of nothing");
  const int64_t M = rows(xs[0]->value);
  int64_t N = 0;
  for (const auto& x : xs) {
    K3_CHECK(rows(x->value) == M, "concat_last: row counts differ");
    N += last_dim(x->value);
  }
  Shape s = xs[0]->value.shape();
  s.back() = N;
  Tensor y = Tensor::empty_on(xs[0]->value.device(), s);
  int64_t off = 0;
  for (const auto& x : xs) {
    const int64_t n = last_dim(x->value);
    blocks::copy_blocks(x->value, {0, n, 0}, y, {off, N, 0}, M, 1, n);
    off += n;
  }
  return make_node(std::move(y), xs, [xs, M, N](Node& self) {
    int64_t o = 0;
    for (const auto& x : xs) {
      const int64_t n = last_dim(x->value);
      if (needs_grad(x)) blocks::add_blocks(self.grad, {o, N, 0}, x->grad_tensor(), {0, n, 0}, M, 1, n);
      o += n;
    }
  }, "concat");
}

Var causal_attention(const Var& q, const Var& k, const Var& v, int64_t B, int64_t T, int64_t H, float sc) {
  const int64_t D = last_dim(q->value), hd = D / H;
  const int64_t Dv = last_dim(v->value), hdv = Dv / H;
  K3_CHECK(rows(q->value) == B * T && D % H == 0 && Dv % H == 0 && last_dim(k->value) == D,
           "causal_attention: q ", q->value.describe(), " k ", k->value.describe(), " v ", v->value.describe(),
           " for B=", B, " T=", T, " H=", H);
  const Device dev = q->value.device();
  Tensor y = Tensor::empty_on(dev, {B * T, Dv});
  if (dev == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    // The flash kernels keep each row's log-sum-exp for the backward. Under Bf16Gemms the operands
    // are bf16 (autocast's split: attention's two products are GEMMs) on the tensor cores; softmax,
    // lse and gradients stay fp32.
    const cuda::AttnShape a{B, T, T, H, hd, hdv, 0, sc};
    const Tensor lse = recording() ? Tensor::empty_on(dev, {B, H, T}) : Tensor();
    const auto st = cuda::gemm_storage(gpu::bf16_gemms());
    {
      using cuda::Operand;
      const Operand qo(q->value.cuda_f32(), q->value.numel(), st), ko(k->value.cuda_f32(), k->value.numel(), st),
          vo(v->value.cuda_f32(), v->value.numel(), st);
      const bool bf16 = st == device::Storage::BF16;
      Tensor yb = bf16 ? Tensor::empty_on(dev, {B * T * Dv}, DType::BF16) : Tensor();
      cuda::attention_forward(qo.ptr, ko.ptr, vo.ptr, bf16 ? yb.raw() : y.cuda_f32(),
                              lse.defined() ? lse.cuda_f32() : nullptr, a, st);
      if (bf16) cuda::widen(yb.raw(), y.cuda_f32(), y.numel(), st);
    }
    return make_node(std::move(y), {q, k, v}, [q, k, v, lse, a, st](Node& self) {
      // The kernel writes all three gradients: inputs that need none get scratch.
      Tensor sq, sk, sv;
      auto target = [](const Var& x, Tensor& scratch) {
        if (needs_grad(x)) return x->grad_cuda();
        scratch = Tensor::zeros_on(Device::CUDA, x->value.shape());
        return scratch.cuda_f32();
      };
      float *dq = target(q, sq), *dk = target(k, sk), *dv = target(v, sv);
      // y went through bf16 on the way out, so its bf16 copy here is the one the forward wrote.
      using cuda::Operand;
      const Operand qo(q->value.cuda_f32(), q->value.numel(), st), ko(k->value.cuda_f32(), k->value.numel(), st),
          vo(v->value.cuda_f32(), v->value.numel(), st), yo(self.value.cuda_f32(), self.value.numel(), st),
          dyo(self.grad.cuda_f32(), self.value.numel(), st);
      cuda::attention_backward(qo.ptr, ko.ptr, vo.ptr, yo.ptr, lse.cuda_f32(), dyo.ptr, dq, dk, dv, a, st);
    }, "attention");
#endif
  }
  // The host form keeps nothing: its backward recomputes the probabilities per sequence instead of
  // keeping B·H·T² of them.
  const AttentionShape s{T, T, H, hd, 0, sc, hdv};
  auto views = [=](const Tensor& tq, const Tensor& tk, const Tensor& tv, int64_t b) {
    return std::array<HeadView, 3>{HeadView{tq.f32() + b * T * D, D, hd}, HeadView{tk.f32() + b * T * D, D, hd},
                                   HeadView{tv.f32() + b * T * Dv, Dv, hdv}};
  };
  for (int64_t b = 0; b < B; ++b) {
    auto [qv, kv, vv] = views(q->value, k->value, v->value, b);
    attention_forward(qv, kv, vv, HeadView{y.f32() + b * T * Dv, Dv, hdv}, s);
  }
  return make_node(std::move(y), {q, k, v}, [=](Node& self) {
    std::vector<float> probs(static_cast<size_t>(H * T * T)), ytmp(static_cast<size_t>(T * Dv));
    Tensor dq = Tensor::zeros(q->value.shape()), dk = Tensor::zeros(k->value.shape()), dv = Tensor::zeros(v->value.shape());
    for (int64_t b = 0; b < B; ++b) {
      auto [qv, kv, vv] = views(q->value, k->value, v->value, b);
      attention_forward(qv, kv, vv, HeadView{ytmp.data(), Dv, hdv}, s, probs.data());
      auto [dqv, dkv, dvv] = views(dq, dk, dv, b);
      attention_backward(qv, kv, vv, probs.data(), HeadView{self.grad.f32() + b * T * Dv, Dv, hdv}, dqv, dkv, dvv, s);
    }
    for (auto [x, g] : {std::pair{q, dq}, std::pair{k, dk}, std::pair{v, dv}})
      if (needs_grad(x)) elementwise::accumulate(x->grad_tensor(), g);
  }, "attention");
}

Var cross_entropy_head(const Var& h, const Var& w, const std::vector<int64_t>& targets, int64_t vc, float z_loss) {
  const int64_t N = h->value.dim(0), V = w->value.dim(0);
  K3_CHECK(int64_t(targets.size()) == N, "cross_entropy: ", targets.size(), " targets for ", N, " rows");
  if (w->value.device() != h->value.device())
    throw error("cross_entropy", "h ", h->value.describe(), " is on ", device_words(h->value.device()), " but W ",
                w->value.describe(), " is on ", device_words(w->value.device()));
  int64_t count = 0;
  for (int64_t t : targets) {
    if (t >= V) throw error("cross_entropy", "target id ", t, " outside the vocabulary of ", V);
    count += t >= 0;
  }
  const bool bf16 = gpu::bf16_gemms();
  auto saved = std::make_shared<cross_entropy::Saved>();
  const double loss = cross_entropy::forward(h->value, w->value, targets, vc, z_loss, bf16, *saved);
  // The loss is a host scalar on either device.
  return make_node(Tensor::full({1}, count ? float(loss / double(count)) : 0.0f), {h, w},
                   [h, w, targets, vc, z_loss, bf16, saved, count](Node& self) {
    const float g = self.grad.to_device(Device::CPU).f32()[0] / float(std::max<int64_t>(count, 1));
    cross_entropy::backward(h->value, w->value, targets, vc, z_loss, bf16, *saved, g, grad_if_needed(h),
                            grad_if_needed(w));
  }, "cross_entropy");
}

Var sum(const Var& a) {
  if (a->value.device() != Device::CPU) throw error("sum", "of the device value ", a->value.describe(), " (no CUDA form)");
  double s = 0;
  for (int64_t i = 0; i < a->value.numel(); ++i) s += a->value.f32()[i];
  Tensor y = Tensor::full({1}, float(s));
  return make_node(std::move(y), {a}, [a](Node& self) {
    const float g = self.grad.f32()[0];
    float* d = a->grad_f32();
    for (int64_t i = 0; i < a->value.numel(); ++i) d[i] += g;
  }, "sum");
}

}  // namespace k3::ag
