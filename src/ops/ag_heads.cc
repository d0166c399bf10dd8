#include "ops/ag_heads.h"

#include "ops/ag_cuda.h"

#include <cstring>

namespace k3::ag {

namespace {
int64_t cols(const Var& x) { return x->value.dim(-1); }
int64_t nrows(const Var& x) { return x->value.numel() / cols(x); }
}  // namespace

Var head_concat(const std::vector<Var>& xs, int64_t H) {
  K3_AG_CUDA(xs.at(0), head_concat(xs, H));
  const int64_t M = nrows(xs[0]);
  std::vector<int64_t> d;
  int64_t total = 0;
  for (const auto& x : xs) {
    K3_CHECK(nrows(x) == M && cols(x) % H == 0, "head_concat: ", x->value.describe(), " with H=", H);
    d.push_back(cols(x) / H);
    total += d.back();
  }
  Tensor y = Tensor::empty({M, H * total});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      float* out = y.f32() + (m * H + h) * total;
      for (size_t i = 0; i < xs.size(); ++i) {
        std::memcpy(out, xs[i]->value.f32() + (m * H + h) * d[i], size_t(d[i]) * 4);
        out += d[i];
      }
    }
  return make_node(std::move(y), xs, [xs, d, H, M, total](Node& self) {
    for (size_t i = 0, off = 0; i < xs.size(); off += size_t(d[i]), ++i) {
      if (!needs_grad(xs[i])) continue;
      float* g = xs[i]->grad_f32();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
          const float* src = self.grad.f32() + (m * H + h) * total + int64_t(off);
          float* dst = g + (m * H + h) * d[i];
          for (int64_t j = 0; j < d[i]; ++j) dst[j] += src[j];
        }
    }
  }, "head_concat");
}

Var head_slice(const Var& x, int64_t H, int64_t begin, int64_t end) {
  K3_AG_CUDA(x, head_slice(x, H, begin, end));
  const int64_t M = nrows(x), hd = cols(x) / H, n = end - begin;
  K3_CHECK(cols(x) % H == 0 && 0 <= begin && begin <= end && end <= hd, "head_slice [", begin, ", ", end, ") of ",
           x->value.describe(), " H=", H);
  Tensor y = Tensor::empty({M, H * n});
  for (int64_t r = 0; r < M * H; ++r) std::memcpy(y.f32() + r * n, x->value.f32() + r * hd + begin, size_t(n) * 4);
  return make_node(std::move(y), {x}, [x, M, H, hd, n, begin](Node& self) {
    float* g = x->grad_f32();
    for (int64_t r = 0; r < M * H; ++r)
      for (int64_t j = 0; j < n; ++j) g[r * hd + begin + j] += self.grad.f32()[r * n + j];
  }, "head_slice");
}

Var broadcast_heads(const Var& x, int64_t H) {
  K3_AG_CUDA(x, broadcast_heads(x, H));
  const int64_t M = nrows(x), d = cols(x);
  Tensor y = Tensor::empty({M, H * d});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) std::memcpy(y.f32() + (m * H + h) * d, x->value.f32() + m * d, size_t(d) * 4);
  return make_node(std::move(y), {x}, [x, M, H, d](Node& self) {
    float* g = x->grad_f32();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < d; ++j) g[m * d + j] += self.grad.f32()[(m * H + h) * d + j];
  }, "broadcast_heads");
}

Var rope(const Var& x, const std::vector<int64_t>& positions, int64_t H, int64_t offset, const RopeTable& table) {
  K3_AG_CUDA(x, rope(x, positions, H, offset, table));
  const int64_t M = nrows(x), hd = cols(x) / H;
  K3_CHECK(int64_t(positions.size()) == M && offset + table.dim <= hd, "rope: ", x->value.describe(), " H=", H);
  Tensor y = x->value.clone();
  rope_apply(y.f32(), M, H, hd, offset, positions.data(), table, +1);
  return make_node(std::move(y), {x}, [x, positions, H, hd, offset, table, M](Node& self) {
    Tensor g = self.grad.clone();
    rope_apply(g.f32(), M, H, hd, offset, positions.data(), table, -1);
    float* dx = x->grad_f32();
    for (int64_t i = 0; i < g.numel(); ++i) dx[i] += g.f32()[i];
  }, "rope");
}

}  // namespace k3::ag
