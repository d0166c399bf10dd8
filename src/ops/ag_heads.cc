#include "ops/ag_heads.h"

#include <cstring>

#include "ops/blocks.h"
#include "ops/device_ids.h"
#include "ops/elementwise.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

namespace k3::ag {

namespace {
int64_t cols(const Var& x) { return x->value.dim(-1); }
int64_t nrows(const Var& x) { return x->value.numel() / cols(x); }
}  // namespace

Var head_concat(const std::vector<Var>& xs, int64_t H) {
  K3_CHECK(!xs.empty(), "head_concat of nothing");
  const int64_t M = nrows(xs[0]);
  std::vector<int64_t> d;
  int64_t total = 0;
  for (const auto& x : xs) {
    K3_CHECK(nrows(x) == M && cols(x) % H == 0, "head_concat: ", x->value.describe(), " with H=", H);
    d.push_back(cols(x) / H);
    total += d.back();
  }
  Tensor y = Tensor::empty_on(xs[0]->value.device(), {M, H * total});
  for (size_t i = 0, off = 0; i < xs.size(); off += size_t(d[i]), ++i)
    blocks::copy_blocks(xs[i]->value, {0, H * d[i], d[i]}, y, {int64_t(off), H * total, total}, M, H, d[i]);
  return make_node(std::move(y), xs, [xs, d, H, M, total](Node& self) {
    for (size_t i = 0, off = 0; i < xs.size(); off += size_t(d[i]), ++i)
      if (needs_grad(xs[i]))
        blocks::add_blocks(self.grad, {int64_t(off), H * total, total}, xs[i]->grad_tensor(), {0, H * d[i], d[i]}, M,
                           H, d[i]);
  }, "head_concat");
}

Var head_slice(const Var& x, int64_t H, int64_t begin, int64_t end) {
  const int64_t M = nrows(x), hd = cols(x) / H, n = end - begin;
  K3_CHECK(cols(x) % H == 0 && 0 <= begin && begin <= end && end <= hd, "head_slice [", begin, ", ", end, ") of ",
           x->value.describe(), " H=", H);
  Tensor y = Tensor::empty_on(x->value.device(), {M, H * n});
  blocks::copy_blocks(x->value, {begin, H * hd, hd}, y, {0, H * n, n}, M, H, n);
  return make_node(std::move(y), {x}, [x, M, H, hd, n, begin](Node& self) {
    blocks::add_blocks(self.grad, {0, H * n, n}, x->grad_tensor(), {begin, H * hd, hd}, M, H, n);
  }, "head_slice");
}

Var broadcast_heads(const Var& x, int64_t H) {
  const int64_t M = nrows(x), d = cols(x);
  Tensor y = Tensor::empty_on(x->value.device(), {M, H * d});
  blocks::copy_blocks(x->value, {0, d, 0}, y, {0, H * d, d}, M, H, d);
  return make_node(std::move(y), {x}, [x, M, H, d](Node& self) {
    for (int64_t h = 0; h < H; ++h) blocks::add_blocks(self.grad, {h * d, H * d, 0}, x->grad_tensor(), {0, d, 0}, M, 1, d);
  }, "broadcast_heads");
}

Var rope(const Var& x, const std::vector<int64_t>& positions, int64_t H, int64_t offset, const RopeTable& table) {
  const int64_t M = nrows(x), hd = cols(x) / H;
  K3_CHECK(int64_t(positions.size()) == M && offset + table.dim <= hd, "rope: ", x->value.describe(), " H=", H);
  Tensor y = x->value.clone();
  // On CUDA the positions and frequencies are uploaded once and kept for the backward (a replayed
  // step's positions are the next ones).
  DeviceIds pos, inv;
  if (y.device() == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    pos = upload_ids(positions, device::Refresh::Advance);
    inv = std::make_shared<device::Buffer>(
        device::upload_new(table.inv_freq.data(), table.inv_freq.size() * sizeof(double), device::Refresh::Constant));
#endif
  }
  // direction -1: the inverse rotation (the backward).
  auto rotate = [positions, pos, inv, M, H, hd, offset, table](const Tensor& t, int direction) {
    if (pos) {
#if defined(K3_HAS_CUDA)
      return cuda::rope_apply(t.cuda_f32(), M, H, hd, offset, table.dim, pos->as<int64_t>(), inv->as<double>(),
                              table.attention_factor, direction, device::Storage::F32, table.half_pairs);
#endif
    }
    rope_apply(t.f32(), M, H, hd, offset, positions.data(), table, direction);
  };
  rotate(y, +1);
  return make_node(std::move(y), {x}, [x, rotate](Node& self) {
    Tensor g = self.grad.clone();
    rotate(g, -1);
    elementwise::accumulate(x->grad_tensor(), g);
  }, "rope");
}

}  // namespace k3::ag
