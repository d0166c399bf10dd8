#include "models/lm_head.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "core/device.h"
#include "core/parallel.h"
#include "core/profile.h"
#include "ops/ag.h"
#include "ops/ag_moe.h"
#include "ops/gemm.h"
#include "ops/ops_cuda.h"

namespace k3 {

namespace {
// The logits of the hidden rows h [B·T, D] (the last row of each sequence for Last) where h lives.
Tensor logits_tensor(Var h, const TokenBatch& batch, Logits which, const Var& head) {
  if (which == Logits::Last && batch.T > 1) {
    std::vector<int64_t> last(static_cast<size_t>(batch.B));
    for (int64_t b = 0; b < batch.B; ++b) last[size_t(b)] = (b + 1) * batch.T - 1;
    h = ag::gather_rows(h, last);
  }
  Tensor lg = ag::linear(h, head, nullptr, WeightLayout::OutIn)->value;
  K3_CHECK(lg.dtype() == DType::F32, "logits: the head gave ", lg.describe());
  return lg;
}
}  // namespace

void head_logits(Var h, const TokenBatch& batch, Logits which, const Var& head, float* out) {
  const int64_t D = h->value.dim(-1), V = head->value.dim(0);
  profile::Scope scope("lm head");
  if (h->value.device() == Device::CUDA) {
    // Straight into the caller's buffer (reused step after step: no fresh pages, no second copy).
    const Tensor lg = logits_tensor(h, batch, which, head);
    device::download(out, lg.raw(), lg.nbytes());
    return;
  }
  if (which == Logits::Last && batch.T > 1) {
    Tensor last = Tensor::empty({batch.B, D});
    for (int64_t b = 0; b < batch.B; ++b)
      std::memcpy(last.f32() + b * D, h->value.f32() + ((b + 1) * batch.T - 1) * D, size_t(D) * 4);
    h = constant(std::move(last));
  }
  const int64_t rows = h->value.numel() / D;
  linear_forward(h->value.f32(), rows, D, V, head->value, WeightLayout::OutIn, nullptr, out);
}

void head_picks_on_device(Var h, const TokenBatch& batch, const Var& head, int64_t* ids) {
  if constexpr (device::kCudaBuilt) {
    std::optional<profile::Scope> scope(std::in_place, "lm head");
    const Tensor lg = logits_tensor(h, batch, Logits::Last, head);
    scope.emplace("greedy pick");
    cuda::argmax_rows(lg.cuda_f32(), batch.B, head->value.dim(0), ids);
  } else {
    device::require_cuda("generate");
  }
}

void head_logits_on_device(Var h, const TokenBatch& batch, const Var& head, void* dst) {
  const profile::Scope scope("lm head");
  const Tensor lg = logits_tensor(h, batch, Logits::Last, head);
  device::copy(dst, lg.raw(), lg.nbytes());
}

void head_picks(Var h, const TokenBatch& batch, const Var& head, int64_t* next) {
  const int64_t V = head->value.dim(0);
  if (h->value.device() == Device::CUDA) {
    device::Buffer ids(size_t(batch.B) * sizeof(int64_t));
    head_picks_on_device(h, batch, head, ids.as<int64_t>());
    device::download(next, ids.get(), size_t(batch.B) * sizeof(int64_t));
    return;
  }
  std::vector<float> out(static_cast<size_t>(batch.B * V));
  head_logits(h, batch, Logits::Last, head, out.data());
  profile::Scope scope("greedy pick");
  parallel_for(batch.B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = out.data() + b * V;
      next[b] = int64_t(std::max_element(row, row + V) - row);
    }
  });
}

}  // namespace k3
