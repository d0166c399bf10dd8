#include "train/optimizer.h"

#include <cmath>

#include "core/device.h"
#include "core/parallel.h"
#include "io/safetensors.h"
#include "ops/ops_cuda.h"

namespace k3 {

void AdamW::step(const Model& model, float lr) {
  ++t_;
  const float b1 = o_.beta1, b2 = o_.beta2;
  const double c1 = 1.0 - std::pow(double(b1), double(t_)), c2 = 1.0 - std::pow(double(b2), double(t_));
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (!p.grad.defined() || !p.grad.has_storage()) return;
    auto& [m, v] = state_[name];
    if (!m.defined()) {
      m = Tensor::zeros(p.value.shape());
      v = Tensor::zeros(p.value.shape());
    }
    const bool decay = kind == ParamKind::Weight || (kind == ParamKind::Embedding && o_.decay_embeddings);
    const float wd = decay ? o_.weight_decay : 0.0f;
    if (p.value.device() == Device::CUDA) {  // the moments live beside the parameter
      if constexpr (device::kCudaBuilt) {
        if (p.value.dtype() != DType::F32) throw error("optimizer", "parameter '", name, "' is not fp32 on the device");
        if (m.device() != Device::CUDA) m = m.to_device(Device::CUDA), v = v.to_device(Device::CUDA);
        cuda::adamw(p.value.cuda_f32(), p.grad.cuda_f32(), m.cuda_f32(), v.cuda_f32(), p.value.numel(),
                    cuda::AdamWStep{lr, b1, b2, o_.eps, wd, t_});
        return;
      }
    }
    float* w = p.value.f32();
    const float* g = p.grad.f32();
    float* pm = m.f32();
    float* pv = v.f32();
    parallel_for(p.value.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {  // elementwise: any split, same values
      for (int64_t i = i0; i < i1; ++i) {
        pm[i] = b1 * pm[i] + (1 - b1) * g[i];
        pv[i] = b2 * pv[i] + (1 - b2) * g[i] * g[i];
        double mhat = pm[i] / c1, vhat = pv[i] / c2;
        w[i] -= lr * float(mhat / (std::sqrt(vhat) + o_.eps) + wd * w[i]);
      }
    });
  });
}

void AdamW::save(const std::string& path) const {
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& [name, mv] : state_) {
    ts.push_back({"exp_avg." + name, mv.first.to_device(Device::CPU)});
    ts.push_back({"exp_avg_sq." + name, mv.second.to_device(Device::CPU)});
  }
  save_safetensors(path, ts, {{"step", std::to_string(t_)}, {"format", "k3-adamw"}});
}

void AdamW::load(const std::string& path, const Model& model) {
  SafeTensors s = SafeTensors::open(path);
  auto it = s.metadata().find("step");
  if (it == s.metadata().end()) throw error("optimizer", path, ": no 'step' in metadata (not a k3 optimizer state?)");
  t_ = std::stoll(it->second);
  state_.clear();
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    if (!s.has("exp_avg." + name)) return;
    Tensor m = s.get_f32("exp_avg." + name).clone(), v = s.get_f32("exp_avg_sq." + name).clone();
    if (m.shape() != p.value.shape())
      throw error("optimizer", path, ": state of '", name, "' has shape ", shape_str(m.shape()), ", the model ",
                  shape_str(p.value.shape()));
    state_[name] = {m, v};
  });
}

void zero_grad(const Model& model) {
  model.visit([](const std::string&, Node& p, ParamKind) { p.grad = Tensor(); });
}

double clip_grad_norm(const Model& model, double max_norm) {
  double sq = 0;
  device::Buffer dev_sq;  // Σ g² of the device gradients, read back once
  model.visit([&](const std::string&, Node& p, ParamKind) {
    if (!p.grad.defined()) return;
    if (p.grad.device() == Device::CUDA) {
      if constexpr (device::kCudaBuilt) {
        if (!dev_sq.get()) dev_sq = device::zeros_f32(2);
        cuda::sum_squares(p.grad.cuda_f32(), p.grad.numel(), dev_sq.as<double>());
      }
      return;
    }
    const float* g = p.grad.f32();
    for (int64_t i = 0, n = p.grad.numel(); i < n; ++i) sq += double(g[i]) * g[i];  // in order: reproducible
  });
  if constexpr (device::kCudaBuilt) {
    if (dev_sq.get()) {
      double d = 0;
      device::download(&d, dev_sq.get(), sizeof d);
      sq += d;
    }
  }
  double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    float s = float(max_norm / (norm + 1e-6));
    model.visit([&](const std::string&, Node& p, ParamKind) {
      if (!p.grad.defined()) return;
      if (p.grad.device() == Device::CUDA) {
        if constexpr (device::kCudaBuilt) {
          cuda::unary(p.grad.cuda_f32(), p.grad.cuda_f32(), p.grad.numel(), cuda::Unary::Scale, s);
        }
        return;
      }
      float* g = p.grad.f32();
      for (int64_t i = 0, n = p.grad.numel(); i < n; ++i) g[i] *= s;
    });
  }
  return norm;
}

float LrSchedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return peak * float(step + 1) / float(warmup);
  const int64_t decay_steps = std::max<int64_t>(1, total - warmup);
  double progress = std::min(1.0, double(step - warmup) / double(decay_steps));
  double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  return float(peak * (min_ratio + (1.0 - min_ratio) * cosine));
}

}  // namespace k3
