#include "core/arena.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace k3 {

Tensor Arena::alloc(Shape shape, DType dtype) {
  size_t bytes = dtype_bytes(dtype, shape_numel(shape));
  size_t need = (bytes + 63) / 64 * 64;
  while (current_ < blocks_.size() && blocks_[current_].size - blocks_[current_].used < need) ++current_;
  if (current_ == blocks_.size()) {
    size_t size = std::max(block_bytes_, need);
    char* p = static_cast<char*>(std::aligned_alloc(64, size));
    if (!p) throw error("arena", "out of memory allocating a block of ", size, " bytes");
    blocks_.push_back({std::shared_ptr<char>(p, [](char* q) { std::free(q); }), size, 0});
  }
  Block& b = blocks_[current_];
  char* ptr = b.data.get() + b.used;
  b.used += need;
  used_total_ += need;
  peak_ = std::max(peak_, used_total_);
  return Tensor::external(ptr, std::move(shape), dtype, b.data);
}

Tensor Arena::zeros(Shape shape, DType dtype) {
  Tensor t = alloc(std::move(shape), dtype);
  if (t.nbytes()) std::memset(t.raw(), 0, t.nbytes());
  return t;
}

void Arena::reset() {
  for (auto& b : blocks_) b.used = 0;
  current_ = 0;
  used_total_ = 0;
}

size_t Arena::bytes_reserved() const {
  size_t s = 0;
  for (const auto& b : blocks_) s += b.size;
  return s;
}

}  // namespace k3
