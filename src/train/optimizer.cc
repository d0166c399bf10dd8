#include "train/optimizer.h"

#include <cmath>

#include "core/device.h"
#include "core/parallel.h"
#include "io/safetensors.h"
#include "ops/optim.h"

namespace k3 {

void AdamW::step(const Model& model, float lr) {
  ++t_;
  const float b1 = o_.beta1, b2 = o_.beta2;
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (!p.grad.defined() || !p.grad.has_storage()) return;
    auto& [m, v] = state_[name];
    if (!m.defined()) {
      m = Tensor::zeros(p.value.shape());
      v = Tensor::zeros(p.value.shape());
    }
    const bool decay = kind == ParamKind::Weight || (kind == ParamKind::Embedding && o_.decay_embeddings);
    const float wd = decay ? o_.weight_decay : 0.0f;
    if (p.value.dtype() != DType::F32) throw error("optimizer", "parameter '", name, "' is not fp32");
    // The moments live beside the parameter.
    if (m.device() != p.value.device()) m = m.to_device(p.value.device()), v = v.to_device(p.value.device());
    adamw_update(p.value, p.grad, m, v, AdamWHyper{lr, b1, b2, o_.eps, wd, t_});
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
  SquareSum sq;
  model.visit([&](const std::string&, Node& p, ParamKind) {
    if (p.grad.defined()) sq.add(p.grad);
  });
  double norm = std::sqrt(sq.total());
  if (max_norm > 0 && norm > max_norm) {
    float s = float(max_norm / (norm + 1e-6));
    model.visit([&](const std::string&, Node& p, ParamKind) {
      if (p.grad.defined()) scale_inplace(p.grad, s);
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
