#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/fastmath.h"

namespace k3 {

void SamplingOptions::validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature))
    throw error("sampler", "temperature ", temperature, " must be >= 0 (0 = greedy)");
  if (top_k < 0) throw error("sampler", "top_k ", top_k, " must be >= 0 (0 = off)");
  if (!(top_p > 0 && top_p <= 1)) throw error("sampler", "top_p ", top_p, " must be in (0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    throw error("sampler", "repetition_penalty ", repetition_penalty, " must be > 0 (1 = off)");
}

namespace {
void penalise(float* logits, int64_t V, const std::vector<int64_t>& history, float penalty) {
  if (penalty == 1.0f) return;
  std::vector<bool> seen(size_t(V), false);
  for (int64_t t : history)
    if (t >= 0 && t < V && !seen[size_t(t)]) {
      seen[size_t(t)] = true;
      float& l = logits[t];
      l = l > 0 ? l / penalty : l * penalty;
    }
}
}  // namespace

std::vector<std::pair<int64_t, double>> Sampler::distribution(float* logits, int64_t V,
                                                              const std::vector<int64_t>& history) {
  penalise(logits, V, history, o_.repetition_penalty);
  if (o_.temperature == 0.0f) return {{std::max_element(logits, logits + V) - logits, 1.0}};
  for (int64_t i = 0; i < V; ++i) logits[i] /= o_.temperature;
  // Candidates sorted by logit (stable: ties keep id order), cut by top-k, then by top-p.
  order_.resize(size_t(V));
  std::iota(order_.begin(), order_.end(), 0);
  const int64_t keep = o_.top_k > 0 ? std::min(o_.top_k, V) : V;
  auto by_logit = [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  order_.resize(size_t(keep));
  const double mx = logits[order_[0]];
  std::vector<std::pair<int64_t, double>> d(order_.size());
  double sum = 0;
  for (size_t i = 0; i < order_.size(); ++i) sum += (d[i] = {order_[i], std::exp(double(logits[order_[i]]) - mx)}).second;
  if (o_.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (always at least one)
    double acc = 0;
    size_t n = d.size();
    for (size_t i = 0; i < d.size(); ++i) {
      acc += d[i].second / sum;
      if (acc >= o_.top_p) {
        n = i + 1;
        break;
      }
    }
    d.resize(n);
    sum = 0;
    for (const auto& e : d) sum += e.second;
  }
  for (auto& e : d) e.second /= sum;
  return d;
}

int64_t Sampler::verify(float* logits, int64_t V, const std::vector<int64_t>& history, int64_t draft) {
  const std::vector<std::pair<int64_t, double>> d = distribution(logits, V, history);
  double p_draft = 0;
  for (const auto& e : d)
    if (e.first == draft) p_draft = e.second;
  if (rng_.uniform_double() < p_draft) return draft;
  // The residual max(p − q, 0), renormalised: p without the draft.
  const double rest = 1.0 - p_draft;
  double u = rng_.uniform_double() * rest, acc = 0;
  int64_t last = -1;
  for (const auto& e : d) {
    if (e.first == draft) continue;
    acc += e.second;
    last = e.first;
    if (u < acc) return e.first;
  }
  return last >= 0 ? last : draft;  // rounding left u at the walk's end (or p was the draft alone)
}

int64_t Sampler::sample(float* logits, int64_t V, const std::vector<int64_t>& history) {
  penalise(logits, V, history, o_.repetition_penalty);
  if (o_.temperature == 0.0f) return std::max_element(logits, logits + V) - logits;  // first max, as torch.argmax
  for (int64_t i = 0; i < V; ++i) logits[i] /= o_.temperature;
  if (o_.top_k == 0 && o_.top_p >= 1.0f) {
    // The whole vocabulary in id order, no sort: weights e^(l − max) by the vectorised exp_approx
    // (≈1.4 ulp; 0 below e^−87), their sum over eight lanes, then the draw walks them in double.
    float top[8];  // the maximum and the sum over eight lanes (independent chains, vectorised)
    std::fill(top, top + 8, -INFINITY);
    const int64_t V8 = V / 8 * 8;
    for (int64_t i = 0; i < V8; i += 8)
      for (int l = 0; l < 8; ++l) top[l] = std::max(top[l], logits[i + l]);
    float mx = -INFINITY;
    for (int64_t i = V8; i < V; ++i) mx = logits[i] > mx ? logits[i] : mx;
    for (float x : top) mx = x > mx ? x : mx;
    weights_.resize(size_t(V));
    float* w = weights_.data();
    exp_array(logits, w, V, mx);
    double lanes[8] = {}, sum = 0;
    for (int64_t i = 0; i < V8; i += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += w[i + l];
    for (int64_t i = V8; i < V; ++i) sum += w[i];
    for (double x : lanes) sum += x;
    const double u = rng_.uniform_double() * sum;
    double acc = 0;
    int64_t last = 0;  // the last id with weight: where rounding leaves u at or past the walk's end
    for (int64_t j = 0; j < V; ++j) {
      if (w[j] == 0.0f) continue;
      acc += w[j];
      last = j;
      if (u < acc) return j;
    }
    return last;
  }
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
