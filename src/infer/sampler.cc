#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace k3 {

void SamplingOptions::validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature))
    throw error("sampler", "temperature ", temperature, " must be >= 0 (0 = greedy)");
  if (top_k < 0) throw error("sampler", "top_k ", top_k, " must be >= 0 (0 = off)");
  if (!(top_p > 0 && top_p <= 1)) throw error("sampler", "top_p ", top_p, " must be in (0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    throw error("sampler", "repetition_penalty ", repetition_penalty, " must be > 0 (1 = off)");
}

int64_t Sampler::sample(float* logits, int64_t V, const std::vector<int64_t>& history) {
  if (o_.repetition_penalty != 1.0f) {
    std::vector<bool> seen(size_t(V), false);
    for (int64_t t : history)
      if (t >= 0 && t < V && !seen[size_t(t)]) {
        seen[size_t(t)] = true;
        float& l = logits[t];
        l = l > 0 ? l / o_.repetition_penalty : l * o_.repetition_penalty;
      }
  }
  if (o_.temperature == 0.0f) return std::max_element(logits, logits + V) - logits;  // first max, as torch.argmax
  for (int64_t i = 0; i < V; ++i) logits[i] /= o_.temperature;
  // Candidates sorted by logit (stable: ties keep id order, so draws are reproducible).
  order_.resize(size_t(V));
  std::iota(order_.begin(), order_.end(), 0);
  int64_t keep = o_.top_k > 0 ? std::min(o_.top_k, V) : V;
  auto by_logit = [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (keep < V || o_.top_p < 1.0f) {
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
    order_.resize(size_t(keep));
  }
  float mx = -INFINITY;
  for (int64_t id : order_) mx = std::max(mx, logits[id]);
  std::vector<double> p(order_.size());
  double sum = 0;
  for (size_t i = 0; i < order_.size(); ++i) sum += p[i] = std::exp(double(logits[order_[i]] - mx));
  size_t n = order_.size();
  if (o_.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (always at least one)
    double acc = 0;
    for (size_t i = 0; i < order_.size(); ++i) {
      acc += p[i] / sum;
      if (acc >= o_.top_p) {
        n = i + 1;
        break;
      }
    }
    sum = 0;
    for (size_t i = 0; i < n; ++i) sum += p[i];
  }
  double u = rng_.uniform_double() * sum, acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += p[i];
    if (u < acc) return order_[i];
  }
  return order_[n - 1];
}

}  // namespace k3
