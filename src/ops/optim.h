// The optimizer's elementwise ops on fp32 tensors, on the device where they live: the AdamW
// update (decoupled weight decay, bias-corrected moments), the sum of squares for gradient-norm
// clipping, and the in-place scale.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace k3 {

struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};
// w ← w − lr·(m̂ / (√v̂ + eps) + wd·w) after m, v take g; all four tensors on one device.
void adamw_update(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h);

// Σ g² over tensors on either device, in order on the host (reproducible); the device part is
// accumulated there and read back once by total().
class SquareSum {
 public:
  void add(const Tensor& g);
  double total() const;

 private:
  double host_ = 0;
  device::Buffer device_;  // two doubles, made when a device tensor arrives
};

void scale_inplace(const Tensor& t, float s);

}  // namespace k3
