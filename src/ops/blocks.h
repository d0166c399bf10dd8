// Blocks of floats moved between two row/head layouts, on either device behind one dispatch on the
// tensors' device: the forward and backward of column slices, concatenations, per-head slices and
// broadcasts across heads (ag.h, ag_heads.h). For m < M, h < H, j < w:
//   dst[d.offset + m·d.row + h·d.head + j]  =  (copy_blocks) or  +=  (add_blocks)
//   src[s.offset + m·s.row + h·s.head + j]
// Both tensors contiguous fp32 on one device; every index inside them.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace k3::blocks {

struct Layout {
  int64_t offset = 0, row = 0, head = 0;
};

void copy_blocks(const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w);
void add_blocks(const Tensor& src, Layout s, const Tensor& dst, Layout d, int64_t M, int64_t H, int64_t w);

}  // namespace k3::blocks
