#include "ops/ag.h"

#include "ops/ag_cuda.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/parallel.h"
#include "core/fastmath.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/blocks.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/norm.h"

namespace k3::ag {

namespace {
int64_t last_dim(const Tensor& t) { return t.ndim() ? t.dim(-1) : 1; }
int64_t rows(const Tensor& t) { return t.numel() / std::max<int64_t>(1, last_dim(t)); }
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
  K3_AG_CUDA(x, linear(x, w, b, layout));
  const int64_t M = rows(x->value);
  Shape ys = x->value.shape();
  ys.back() = out;
  Tensor y = Tensor::empty(ys);
  linear_forward(x->value.f32(), M, in, out, W, layout, b ? b->value.f32() : nullptr, y.f32());
  return make_node(std::move(y), {x, w, b}, [=](Node& self) {
    const float* dy = self.grad.f32();
    linear_backward(x->value.f32(), dy, M, in, out, w->value, layout, needs_grad(x) ? x->grad_f32() : nullptr,
                    needs_grad(w) ? w->grad_f32() : nullptr, needs_grad(b) ? b->grad_f32() : nullptr);
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
Tensor grad_if_needed(const Var& x) { return needs_grad(x) ? x->grad_tensor() : Tensor(); }
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

Var position_embedding(const Var& table, const std::vector<int64_t>& positions) {
  K3_AG_CUDA(table, position_embedding(table, positions));
  return embedding(table, positions);
}

Var embedding(const Var& table, const std::vector<int64_t>& ids, std::optional<int64_t> padding_idx) {
  K3_AG_CUDA(table, embedding(table, ids, padding_idx));
  const int64_t D = table->value.dim(1), n = int64_t(ids.size());
  Tensor y = Tensor::empty({n, D});
  embedding_forward(table->value, ids.data(), n, y.f32());
  return make_node(std::move(y), {table}, [table, ids, D, padding_idx](Node& self) {
    if (!padding_idx) return embedding_backward(ids.data(), int64_t(ids.size()), D, self.grad.f32(), table->grad_f32());
    std::vector<int64_t> kept;
    std::vector<float> g;
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] != *padding_idx) {
        kept.push_back(ids[i]);
        g.insert(g.end(), self.grad.f32() + int64_t(i) * D, self.grad.f32() + int64_t(i + 1) * D);
      }
    embedding_backward(kept.data(), int64_t(kept.size()), D, g.data(), table->grad_f32());
  }, "embedding");
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
  K3_AG_CUDA(q, causal_attention(q, k, v, B, T, H, sc));
  const int64_t D = last_dim(q->value), hd = D / H;
  const int64_t Dv = last_dim(v->value), hdv = Dv / H;
  K3_CHECK(rows(q->value) == B * T && D % H == 0 && Dv % H == 0 && last_dim(k->value) == D,
           "causal_attention: q ", q->value.describe(), " k ", k->value.describe(), " v ", v->value.describe(),
           " for B=", B, " T=", T, " H=", H);
  Tensor y = Tensor::empty({B * T, Dv});
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
    // Recompute the probabilities per sequence instead of keeping B·H·T² of them.
    std::vector<float> probs(static_cast<size_t>(H * T * T)), ytmp(static_cast<size_t>(T * Dv));
    Tensor dq = Tensor::zeros(q->value.shape()), dk = Tensor::zeros(k->value.shape()), dv = Tensor::zeros(v->value.shape());
    for (int64_t b = 0; b < B; ++b) {
      auto [qv, kv, vv] = views(q->value, k->value, v->value, b);
      attention_forward(qv, kv, vv, HeadView{ytmp.data(), Dv, hdv}, s, probs.data());
      auto [dqv, dkv, dvv] = views(dq, dk, dv, b);
      attention_backward(qv, kv, vv, probs.data(), HeadView{self.grad.f32() + b * T * Dv, Dv, hdv}, dqv, dkv, dvv, s);
    }
    auto acc = [](const Var& x, const Tensor& g) {
      if (!needs_grad(x)) return;
      float* d = x->grad_f32();
      for (int64_t i = 0; i < g.numel(); ++i) d[i] += g.f32()[i];
    };
    acc(q, dq);
    acc(k, dk);
    acc(v, dv);
  }, "attention");
}

Var cross_entropy_head(const Var& h, const Var& w, const std::vector<int64_t>& targets, int64_t vc, float z_loss) {
  K3_AG_CUDA(h, cross_entropy_head(h, w, targets, z_loss));
  const int64_t N = h->value.dim(0), D = h->value.dim(1), V = w->value.dim(0);
  K3_CHECK(int64_t(targets.size()) == N, "cross_entropy: ", targets.size(), " targets for ", N, " rows");
  auto lse = std::make_shared<std::vector<float>>(size_t(N));
  std::vector<float> mx(size_t(N), -INFINITY), se(size_t(N), 0.0f), tgt(size_t(N), 0.0f);
  std::vector<float> chunk(size_t(N * std::min(vc, V)));
  int64_t count = 0;
  for (int64_t t : targets) {
    if (t >= V) throw error("cross_entropy", "target id ", t, " outside the vocabulary of ", V);
    count += t >= 0;
  }
  // Online log-sum-exp over vocabulary chunks.
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    gemm(Trans::No, Trans::Yes, N, n, D, 1.0f, h->value.f32(), D, w->value.f32() + v0 * D, D, 0.0f, chunk.data(), n);
    parallel_for(N, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = chunk.data() + r * n;
        const int64_t t = targets[size_t(r)];
        if (t >= v0 && t < v0 + n) tgt[size_t(r)] = row[t - v0];
        float m = mx[size_t(r)];
        for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
        exp_array(row, row, n, m);  // the row is scratch from here on
        float s = se[size_t(r)] * std::exp(mx[size_t(r)] - m);
        for (int64_t j = 0; j < n; ++j) s += row[j];
        mx[size_t(r)] = m;
        se[size_t(r)] = s;
      }
    });
  }
  double loss = 0;
  for (int64_t r = 0; r < N; ++r) {
    (*lse)[size_t(r)] = mx[size_t(r)] + std::log(se[size_t(r)]);
    if (targets[size_t(r)] >= 0)
      loss += (*lse)[size_t(r)] - tgt[size_t(r)] + double(z_loss) * (*lse)[size_t(r)] * (*lse)[size_t(r)];
  }
  Tensor y = Tensor::full({1}, count ? float(loss / double(count)) : 0.0f);
  return make_node(std::move(y), {h, w}, [=](Node& self) {
    const float g = self.grad.f32()[0] / float(std::max<int64_t>(count, 1));
    std::vector<float> c(size_t(N * std::min(vc, V)));
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t n = std::min(vc, V - v0);
      gemm(Trans::No, Trans::Yes, N, n, D, 1.0f, h->value.f32(), D, w->value.f32() + v0 * D, D, 0.0f, c.data(), n);
      parallel_for(N, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {  // dlogits = g (softmax - onehot), zero for ignored rows
          float* row = c.data() + r * n;
          const int64_t t = targets[size_t(r)];
          if (t < 0) {
            std::fill(row, row + n, 0.0f);
            continue;
          }
          // d/dz of lse - z_t + c·lse² is softmax·(1 + 2c·lse) - onehot.
          const float l = (*lse)[size_t(r)], scale = g * (1.0f + 2.0f * z_loss * l);
          exp_array(row, row, n, l);
          for (int64_t j = 0; j < n; ++j) row[j] *= scale;
          if (t >= v0 && t < v0 + n) row[t - v0] -= g;
        }
      });
      if (needs_grad(h)) gemm(Trans::No, Trans::No, N, D, n, 1.0f, c.data(), n, w->value.f32() + v0 * D, D, 1.0f, h->grad_f32(), D);
      if (needs_grad(w)) gemm(Trans::Yes, Trans::No, n, D, N, 1.0f, c.data(), n, h->value.f32(), D, 1.0f, w->grad_f32() + v0 * D, D);
    }
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
