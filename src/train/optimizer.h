// AdamW with decoupled weight decay (Loshchilov & Hutter), the warmup + cosine schedule,
// global-norm gradient clipping. Parameters come from the model's visitor, by name, so the
// optimizer state saves and resumes by name too.
#pragma once

#include <map>
#include <string>

#include "models/model.h"

namespace k3 {

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;
  // Decay applies to matrices only by default: not to norms, biases, embeddings (the usual
  // GPT-2/llm.c practice).
  bool decay_embeddings = false;
};

class AdamW {
 public:
  explicit AdamW(const AdamWOptions& o) : o_(o) {}
  // One update of every parameter that has a gradient, at learning rate lr.
  void step(const Model& model, float lr);
  int64_t steps() const { return t_; }
  const AdamWOptions& options() const { return o_; }

  // Moments by parameter name, for checkpoints.
  void save(const std::string& path) const;
  void load(const std::string& path, const Model& model);

 private:
  AdamWOptions o_;
  int64_t t_ = 0;
  std::map<std::string, std::pair<Tensor, Tensor>> state_;  // m, v
};

void zero_grad(const Model& model);
// Scales all gradients so their global L2 norm is at most max_norm; returns the norm before.
double clip_grad_norm(const Model& model, double max_norm);

struct LrSchedule {
  float peak = 1e-3f, min_ratio = 0.1f;
  int64_t warmup = 0, total = 1;
  float at(int64_t step) const;  // linear warmup to peak, cosine decay to peak·min_ratio
};

}  // namespace k3
