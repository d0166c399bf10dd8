// Differentiable ops for mixture-of-experts routing, dispatch and combine (spec §8). Every op
// does work proportional to the rows it touches (tokens × top-k), never to the expert count
// times the token count. Index arguments are plain integers: selection is not differentiable.
#pragma once

#include <vector>

#include "ops/autograd.h"

namespace k3::ag {

// Softmax along the last dimension.
Var softmax_last(const Var& x);

// y[i] = x[rows[i]]: x [M, D] -> [rows.size(), D]. Backward scatter-adds into x.
Var gather_rows(const Var& x, std::vector<int64_t> rows);

// y[m, k] = s[m, idx[m·K + k]] (+ offset[idx]): s [M, E] -> [M, K]. The optional offset [E] is a
// constant (no gradient): it reproduces combine weights read from bias-corrected scores.
Var gather_cols(const Var& s, std::vector<int64_t> idx, int64_t K, const Tensor& offset = Tensor());

// y = w / (Σ_last w + eps), row by row (top-k renormalisation, spec §8.1 step 7).
Var normalize_sum_last(const Var& w, float eps);

// Grouping of (token, slot) pairs by expert, in CSR form: the pairs routed to active expert j
// (id experts[j]) are positions [offsets[j], offsets[j+1]) of rows (token index) and slots
// (m·K + k, a position in the [M, K] combine-weight matrix).
struct Dispatch {
  std::vector<int64_t> experts;
  std::vector<int64_t> offsets;
  std::vector<int64_t> rows;
  std::vector<int64_t> slots;

  int64_t active() const { return static_cast<int64_t>(experts.size()); }
  std::vector<int64_t> rows_of(int64_t j) const;  // the token rows of active expert j
};

// Groups idx [M·K] (expert ids in [0, E)) by expert; experts in increasing id order, rows in
// increasing token order within an expert.
Dispatch make_dispatch(const std::vector<int64_t>& idx, int64_t M, int64_t K, int64_t E);

// out[rows[p]] += w[slots[p]] · ys[j][p − offsets[j]] over all pairs p of all active experts j:
// ys[j] is [offsets[j+1] − offsets[j], N], w is [M, K], out is [M, N]. Gradients flow to every
// ys[j] and to w.
Var weighted_combine(const std::vector<Var>& ys, const Dispatch& d, const Var& w, int64_t M);

// DeepSeek-V3 sequence-wise balance loss over B = M / T sequences of T tokens:
//   L = α/B Σ_b Σ_e f_{b,e} P_{b,e},  f_{b,e} = E/(K·T) · #{t in b: e ∈ topk(t)},
//   P_{b,e} = 1/T Σ_{t in b} s_{t,e} / Σ_j s_{t,j}.
// scores [M, E] (sigmoid or softmax affinities), idx [M·K] the selected experts. Scalar [1].
Var seq_balance_loss(const Var& scores, const std::vector<int64_t>& idx, int64_t K, int64_t T, float alpha);

}  // namespace k3::ag
