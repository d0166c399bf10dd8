// Arena: bump allocation of activation tensors for one forward pass; reset() recycles it all.
// Blocks are kept between passes, so a steady-state decode loop allocates nothing.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"

namespace k3 {

class Arena {
 public:
  explicit Arena(size_t block_bytes = size_t(16) << 20) : block_bytes_(block_bytes) {}
  Tensor alloc(Shape shape, DType dtype = DType::F32);  // uninitialised
  Tensor zeros(Shape shape, DType dtype = DType::F32);
  void reset();                  // every tensor handed out since the last reset becomes invalid
  size_t bytes_reserved() const;  // total held in blocks
  size_t bytes_used() const { return used_total_; }
  size_t peak_bytes() const { return peak_; }

 private:
  struct Block {
    std::shared_ptr<char> data;
    size_t size = 0, used = 0;
  };
  std::vector<Block> blocks_;
  size_t current_ = 0;
  size_t block_bytes_;
  size_t used_total_ = 0, peak_ = 0;
};

}  // namespace k3
