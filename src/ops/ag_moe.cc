#include "ops/ag_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/parallel.h"
#include "ops/device_ids.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

namespace k3::ag {

namespace {
int64_t cols(const Tensor& t) { return t.ndim() ? t.dim(-1) : 1; }
int64_t nrows(const Tensor& t) { return t.numel() / std::max<int64_t>(1, cols(t)); }
}  // namespace

namespace {
void softmax_host(const float* px, float* py, int64_t M, int64_t N) {
  parallel_for(M, 64, [&](int64_t s, int64_t e) {
    for (int64_t m = s; m < e; ++m) {
      const float* r = px + m * N;
      float* o = py + m * N;
      float mx = -INFINITY;
      for (int64_t j = 0; j < N; ++j) mx = std::max(mx, r[j]);
      double z = 0;
      for (int64_t j = 0; j < N; ++j) z += (o[j] = std::exp(r[j] - mx));
      const float inv = static_cast<float>(1.0 / z);
      for (int64_t j = 0; j < N; ++j) o[j] *= inv;
    }
  });
}

void softmax_host_backward(const float* p, const float* g, float* d, int64_t M, int64_t N) {
  // dx = p ⊙ (g − Σ g·p)
  for (int64_t m = 0; m < M; ++m) {
    double dot = 0;
    for (int64_t j = 0; j < N; ++j) dot += double(g[m * N + j]) * p[m * N + j];
    for (int64_t j = 0; j < N; ++j) d[m * N + j] += p[m * N + j] * (g[m * N + j] - static_cast<float>(dot));
  }
}
}  // namespace

Var softmax_last(const Var& x) {
  const int64_t N = cols(x->value), M = nrows(x->value);
  Tensor y = Tensor::empty_on(x->value.device(), x->value.shape());
  if (x->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    cuda::softmax_rows(x->value.cuda_f32(), y.cuda_f32(), M, N);
#endif
  } else {
    softmax_host(x->value.f32(), y.f32(), M, N);
  }
  return make_node(std::move(y), {x}, [x, M, N](Node& self) {
    if (x->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
      return cuda::softmax_rows_backward(self.value.cuda_f32(), self.grad.cuda_f32(), x->grad_cuda(), M, N);
#endif
    }
    softmax_host_backward(self.value.f32(), self.grad.f32(), x->grad_f32(), M, N);
  }, "softmax");
}

Var gather_rows(const Var& x, std::vector<int64_t> rows) {
  const int64_t D = cols(x->value), M = nrows(x->value), n = static_cast<int64_t>(rows.size());
  for (int64_t r : rows)
    if (r < 0 || r >= M) throw error("gather_rows", "row ", r, " outside [0, ", M, ")");
  const bool cuda = x->value.device() == Device::CUDA;
  Tensor y = Tensor::empty_on(x->value.device(), {n, D});
  DeviceIds ids;
  if (cuda) {
#if defined(K3_HAS_CUDA)
    ids = upload_ids(rows);
    cuda::gather_rows(x->value.cuda_f32(), ids->as<int64_t>(), n, D, y.cuda_f32());
#endif
  } else {
    const float* px = x->value.f32();
    float* py = y.f32();
    for (int64_t i = 0; i < n; ++i) std::memcpy(py + i * D, px + rows[size_t(i)] * D, size_t(D) * sizeof(float));
  }
  return make_node(std::move(y), {x}, [x, rows = std::move(rows), ids, D, n](Node& self) {
    if (ids) {
#if defined(K3_HAS_CUDA)
      return cuda::scatter_add_rows(self.grad.cuda_f32(), ids->as<int64_t>(), n, D, x->grad_cuda());
#endif
    }
    const float* g = self.grad.f32();
    float* d = x->grad_f32();
    for (size_t i = 0; i < rows.size(); ++i) {
      float* dr = d + rows[i] * D;
      const float* gr = g + int64_t(i) * D;
      for (int64_t c = 0; c < D; ++c) dr[c] += gr[c];
    }
  }, "gather_rows");
}

Var gather_cols(const Var& s, std::vector<int64_t> idx, int64_t K, const Tensor& offset) {
  const int64_t E = cols(s->value), M = nrows(s->value);
  K3_CHECK(static_cast<int64_t>(idx.size()) == M * K, "gather_cols: ", idx.size(), " indices for ", M, "x", K);
  const bool has_offset = offset.defined() && offset.numel() > 0;
  K3_CHECK(!has_offset || offset.numel() == E, "gather_cols: offset of ", offset.numel(), " for ", E, " columns");
  for (int64_t e : idx)
    if (e < 0 || e >= E) throw error("gather_cols", "column ", e, " outside [0, ", E, ")");
  if (has_offset && offset.device() != s->value.device())
    throw error("gather_cols", "scores ", s->value.describe(), " are on ", device_words(s->value.device()),
                " but the offset ", offset.describe(), " is on ", device_words(offset.device()));
  const bool cuda = s->value.device() == Device::CUDA;
  Tensor y = Tensor::empty_on(s->value.device(), {M, K});
  DeviceIds ids;
  if (cuda) {
#if defined(K3_HAS_CUDA)
    ids = upload_ids(idx);
    cuda::gather_cols(s->value.cuda_f32(), ids->as<int64_t>(), has_offset ? offset.cuda_f32() : nullptr, M, E, K,
                      y.cuda_f32());
#endif
  } else {
    const float* ps = s->value.f32();
    const float* po = has_offset ? offset.f32() : nullptr;
    float* py = y.f32();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = idx[size_t(m * K + k)];
        py[m * K + k] = ps[m * E + e] + (po ? po[e] : 0.0f);
      }
  }
  return make_node(std::move(y), {s}, [s, idx = std::move(idx), ids, K, E, M](Node& self) {
    if (ids) {
#if defined(K3_HAS_CUDA)
      return cuda::scatter_cols_add(self.grad.cuda_f32(), ids->as<int64_t>(), M, E, K, s->grad_cuda());
#endif
    }
    const float* g = self.grad.f32();
    float* d = s->grad_f32();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) d[m * E + idx[size_t(m * K + k)]] += g[m * K + k];
  }, "gather_cols");
}

namespace {
void normalize_sum_host(const float* pw, float* py, int64_t M, int64_t N, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    float sum = 0;
    for (int64_t j = 0; j < N; ++j) sum += pw[m * N + j];
    const float den = sum + eps;
    for (int64_t j = 0; j < N; ++j) py[m * N + j] = pw[m * N + j] / den;
  }
}

void normalize_sum_host_backward(const float* pw2, const float* py2, const float* g, float* d, int64_t M, int64_t N,
                                 float eps) {
  // y_i = w_i / S with S = Σ w + eps:  dw_j = g_j / S − Σ_i g_i y_i / S
  for (int64_t m = 0; m < M; ++m) {
    float sum = 0;
    for (int64_t j = 0; j < N; ++j) sum += pw2[m * N + j];
    const float den = sum + eps;
    double gy = 0;
    for (int64_t j = 0; j < N; ++j) gy += double(g[m * N + j]) * py2[m * N + j];
    for (int64_t j = 0; j < N; ++j) d[m * N + j] += (g[m * N + j] - static_cast<float>(gy)) / den;
  }
}
}  // namespace

Var normalize_sum_last(const Var& w, float eps) {
  const int64_t N = cols(w->value), M = nrows(w->value);
  Tensor y = Tensor::empty_on(w->value.device(), w->value.shape());
  if (w->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    cuda::normalize_sum_rows(w->value.cuda_f32(), y.cuda_f32(), M, N, eps);
#endif
  } else {
    normalize_sum_host(w->value.f32(), y.f32(), M, N, eps);
  }
  return make_node(std::move(y), {w}, [w, M, N, eps](Node& self) {
    if (w->value.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
      return cuda::normalize_sum_rows_backward(w->value.cuda_f32(), self.value.cuda_f32(), self.grad.cuda_f32(),
                                               w->grad_cuda(), M, N, eps);
#endif
    }
    normalize_sum_host_backward(w->value.f32(), self.value.f32(), self.grad.f32(), w->grad_f32(), M, N, eps);
  }, "normalize_sum");
}

std::vector<int64_t> Dispatch::rows_of(int64_t j) const {
  return std::vector<int64_t>(rows.begin() + offsets[size_t(j)], rows.begin() + offsets[size_t(j) + 1]);
}

Dispatch make_dispatch(const std::vector<int64_t>& idx, int64_t M, int64_t K, int64_t E) {
  K3_CHECK(static_cast<int64_t>(idx.size()) == M * K, "make_dispatch: ", idx.size(), " indices for ", M, "x", K);
  // Counting sort by expert: O(M·K + E) (the E term is a counter array, no per-expert work).
  std::vector<int64_t> count(static_cast<size_t>(E) + 1, 0);
  for (int64_t e : idx) {
    K3_CHECK(e >= 0 && e < E, "make_dispatch: expert ", e, " of ", E);
    ++count[size_t(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[size_t(e) + 1] += count[size_t(e)];
  Dispatch d;
  d.rows.resize(idx.size());
  d.slots.resize(idx.size());
  std::vector<int64_t> pos(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < M * K; ++p) {  // token order is kept within an expert
    const int64_t e = idx[size_t(p)];
    const int64_t q = pos[size_t(e)]++;
    d.rows[size_t(q)] = p / K;
    d.slots[size_t(q)] = p;
  }
  d.offsets.push_back(0);
  for (int64_t e = 0; e < E; ++e)
    if (count[size_t(e) + 1] > count[size_t(e)]) {
      d.experts.push_back(e);
      d.offsets.push_back(count[size_t(e) + 1]);
    }
  return d;
}

Var weighted_combine(const std::vector<Var>& ys, const Dispatch& d, const Var& w, int64_t M) {
  K3_CHECK(static_cast<int64_t>(ys.size()) == d.active(), "weighted_combine: ", ys.size(), " outputs for ", d.active(),
           " experts");
  const int64_t K = M ? w->value.numel() / M : 0;
  K3_CHECK(w->value.numel() == M * K, "weighted_combine: weights ", w->value.describe(), " for ", M, " rows");
  const int64_t N = ys.empty() ? 0 : cols(ys[0]->value);
  for (size_t j = 0; j < ys.size(); ++j) {
    K3_CHECK(cols(ys[j]->value) == N && nrows(ys[j]->value) == d.offsets[j + 1] - d.offsets[j],
             "weighted_combine: expert output ", ys[j]->value.describe());
    if (ys[j]->value.device() != w->value.device())
      throw error("weighted_combine", "expert output ", ys[j]->value.describe(), " is on ",
                  device_words(ys[j]->value.device()), " but the weights are on ", device_words(w->value.device()));
  }
  Tensor out = Tensor::zeros_on(w->value.device(), {M, N});
  // On CUDA the dispatch's rows and slots are uploaded once and kept for the backward.
  DeviceIds d_rows, d_slots;
  if (out.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    d_rows = upload_ids(d.rows);
    d_slots = upload_ids(d.slots);
    for (size_t j = 0; j < ys.size(); ++j) {
      const int64_t p0 = d.offsets[j], n = d.offsets[j + 1] - p0;
      cuda::scatter_weighted(ys[j]->value.cuda_f32(), d_rows->as<int64_t>() + p0, d_slots->as<int64_t>() + p0,
                             w->value.cuda_f32(), n, N, out.cuda_f32());
    }
#endif
  } else {
    float* po = out.f32();
    const float* pw = w->value.f32();
    for (size_t j = 0; j < ys.size(); ++j) {
      const float* py = ys[j]->value.f32();
      for (int64_t p = d.offsets[j]; p < d.offsets[j + 1]; ++p) {
        const float wt = pw[d.slots[size_t(p)]];
        const float* yr = py + (p - d.offsets[j]) * N;
        float* orow = po + d.rows[size_t(p)] * N;
        for (int64_t c = 0; c < N; ++c) orow[c] += wt * yr[c];
      }
    }
  }
  std::vector<Var> parents = ys;
  parents.push_back(w);
  return make_node(std::move(out), std::move(parents), [ys, d, w, N, d_rows, d_slots](Node& self) {
    if (d_rows) {
#if defined(K3_HAS_CUDA)
      float* dw = needs_grad(w) ? w->grad_cuda() : nullptr;
      for (size_t j = 0; j < ys.size(); ++j) {
        const int64_t p0 = d.offsets[j], n = d.offsets[j + 1] - p0;
        cuda::scatter_weighted_backward(self.grad.cuda_f32(), ys[j]->value.cuda_f32(), d_rows->as<int64_t>() + p0,
                                        d_slots->as<int64_t>() + p0, w->value.cuda_f32(), n, N,
                                        needs_grad(ys[j]) ? ys[j]->grad_cuda() : nullptr, dw);
      }
      return;
#endif
    }
    const float* g = self.grad.f32();
    const float* pw2 = w->value.f32();
    float* dw = needs_grad(w) ? w->grad_f32() : nullptr;
    for (size_t j = 0; j < ys.size(); ++j) {
      const float* py = ys[j]->value.f32();
      float* dy = needs_grad(ys[j]) ? ys[j]->grad_f32() : nullptr;
      for (int64_t p = d.offsets[j]; p < d.offsets[j + 1]; ++p) {
        const int64_t i = p - d.offsets[j];
        const float* grow = g + d.rows[size_t(p)] * N;
        const float wt = pw2[d.slots[size_t(p)]];
        if (dy)
          for (int64_t c = 0; c < N; ++c) dy[i * N + c] += wt * grow[c];
        if (dw) {
          double dot = 0;
          for (int64_t c = 0; c < N; ++c) dot += double(grow[c]) * py[i * N + c];
          dw[d.slots[size_t(p)]] += static_cast<float>(dot);
        }
      }
    }
  }, "weighted_combine");
}

Var seq_balance_loss(const Var& scores, const std::vector<int64_t>& idx, int64_t K, int64_t T, float alpha) {
  const int64_t E = cols(scores->value), M = nrows(scores->value);
  if (T <= 0 || M % T != 0)
    throw error("moe", "balance loss: ", M, " routed tokens are not a whole number of sequences of length ", T);
  K3_CHECK(static_cast<int64_t>(idx.size()) == M * K, "seq_balance_loss: ", idx.size(), " indices for ", M, "x", K);
  const int64_t B = M / T;
  // f [B, E]: scaled selection frequency per sequence (a constant of the loss).
  auto f = std::make_shared<std::vector<float>>(static_cast<size_t>(B * E), 0.0f);
  const float fscale = static_cast<float>(E) / static_cast<float>(K * T);
  for (int64_t p = 0; p < M * K; ++p) (*f)[size_t((p / K) / T * E + idx[size_t(p)])] += fscale;
  // On CUDA the [M, E] scores come to the host (small beside the activations; the routing read
  // them there already) and the gradient goes back in the backward.
  const bool dev = scores->value.device() == Device::CUDA;
  const Tensor host = dev ? scores->value.to_device(Device::CPU) : scores->value;
  const float* ps = host.f32();
  double loss = 0;
  for (int64_t m = 0; m < M; ++m) {
    const float* r = ps + m * E;
    const float* fb = f->data() + (m / T) * E;
    double S = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e) {
      S += r[e];
      dot += double(fb[e]) * r[e];
    }
    loss += dot / S;
  }
  const double c = double(alpha) / double(B * T);
  Tensor y = Tensor::full({1}, static_cast<float>(c * loss));
  return make_node(std::move(y), {scores}, [scores, host, dev, f, E, M, T, c](Node& self) {
    // d/ds_{t,j} of (Σ_e f_e s_e)/S = (f_j − (Σ_e f_e s_e)/S) / S
    const double g = double(self.grad.f32()[0]) * c;
    const float* ps2 = host.f32();
    Tensor staged = dev ? Tensor::zeros(host.shape()) : Tensor();
    float* d = dev ? staged.f32() : scores->grad_f32();
    for (int64_t m = 0; m < M; ++m) {
      const float* r = ps2 + m * E;
      const float* fb = f->data() + (m / T) * E;
      double S = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) {
        S += r[e];
        dot += double(fb[e]) * r[e];
      }
      for (int64_t e = 0; e < E; ++e) d[m * E + e] += static_cast<float>(g * (fb[e] - dot / S) / S);
    }
#if defined(K3_HAS_CUDA)
    if (dev) {
      const Tensor up = staged.to_device(Device::CUDA);
      cuda::add_inplace(scores->grad_cuda(), up.cuda_f32(), up.numel());
    }
#endif
  }, "seq_balance_loss");
}

}  // namespace k3::ag
