#include "ops/blocks.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

namespace k3::blocks {

namespace {
// The furthest element a layout reaches, inside its tensor; both on one device.
Device check(const char* op, const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w) {
  for (const Tensor* t : {&src, &dst})
    if (!t->defined() || t->dtype() != DType::F32 || !t->is_contiguous() || !t->has_storage())
      throw error(op, "needs contiguous fp32 tensors with values, got ", t->defined() ? t->describe() : "nothing");
  if (src.device() != dst.device())
    throw error(op, src.describe(), " is on ", device_words(src.device()), " but ", dst.describe(), " is on ",
                device_words(dst.device()));
  if (M > 0 && H > 0 && w > 0) {
    auto last = [&](Layout l) { return l.offset + (M - 1) * l.row + (H - 1) * l.head + w - 1; };
    K3_CHECK(s.offset >= 0 && d.offset >= 0 && last(s) < src.numel() && last(d) < dst.numel(), op, ": blocks of ", M,
             "x", H, "x", w, " outside ", src.describe(), " or ", dst.describe());
  }
  return src.device();
}
}  // namespace

namespace {
// dst = src (add false) or dst += src over the blocks, on the host.
void host_blocks(const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w, bool add) {
  const float* ps = src.f32() + s.offset;
  float* pd = dst.f32() + d.offset;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      const float* a = ps + m * s.row + h * s.head;
      float* b = pd + m * d.row + h * d.head;
      if (add)
        for (int64_t j = 0; j < w; ++j) b[j] += a[j];
      else
        std::memcpy(b, a, size_t(w) * sizeof(float));
    }
}
}  // namespace

void copy_blocks(const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w) {
  if (check("copy_blocks", src, s, dst, d, M, H, w) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::copy_blocks(src.cuda_f32() + s.offset, s.row, s.head, dst.cuda_f32() + d.offset, d.row, d.head, M, H, w);
#endif
  }
  host_blocks(src, s, dst, d, M, H, w, false);
}

void add_blocks(const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w) {
  if (check("add_blocks", src, s, dst, d, M, H, w) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::add_blocks(src.cuda_f32() + s.offset, s.row, s.head, dst.cuda_f32() + d.offset, d.row, d.head, M, H, w);
#endif
  }
  host_blocks(src, s, dst, d, M, H, w, true);
}

}  // namespace k3::blocks
