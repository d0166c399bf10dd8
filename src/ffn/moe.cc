#include "ffn/moe.h"

#include "ffn/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "core/parallel.h"
#include "core/profile.h"
#include "ffn/moe_group_score.h"
#include "ops/ag_heads.h"

namespace k3 {

namespace {

// Descending by value, ties to the lower index: a deterministic top-k. NaN ranks last so that the
// order stays a strict weak ordering (std::partial_sort needs one).
struct ByScore {
  const float* v;
  static float key(float f) { return std::isnan(f) ? -INFINITY : f; }
  bool operator()(int64_t a, int64_t b) const {
    const float x = key(v[a]), y = key(v[b]);
    return x > y || (x == y && a < b);
  }
};

GluOptions glu_options(const MoeOptions& o, const GluNames& names) {
  GluOptions g;
  g.activation = o.activation;
  g.situ = o.situ;
  g.names = names;
  return g;
}

void validate(const MoeOptions& o) {
  if (o.d_model <= 0 || o.n_experts <= 0 || o.expert_hidden <= 0)
    throw error("moe", "d_model, n_experts and moe_intermediate_size must be positive (got ", o.d_model, ", ",
                o.n_experts, ", ", o.expert_hidden, ")");
  if (o.top_k <= 0 || o.top_k > o.n_experts)
    throw error("moe", "top-k ", o.top_k, " must be in [1, ", o.n_experts, "]");
  if (o.n_group <= 0 || o.n_experts % o.n_group != 0)
    throw error("moe", o.n_experts, " experts cannot be split into ", o.n_group, " groups");
  if (o.topk_group <= 0 || o.topk_group > o.n_group)
    throw error("moe", "topk_group ", o.topk_group, " must be in [1, n_group = ", o.n_group, "]");
  if (o.top_k > o.topk_group * (o.n_experts / o.n_group))
    throw error("moe", "top-k ", o.top_k, " exceeds the ", o.topk_group * (o.n_experts / o.n_group),
                " experts of the kept groups");
  if (o.n_shared < 0 || o.latent_dim < 0) throw error("moe", "negative shared-expert count or latent width");
  if (o.latent_norm != LatentNorm::None && o.latent_dim == 0)
    throw error("moe", "latent_moe_use_norm needs a latent width (routed_expert_hidden_size)");
}

}  // namespace

std::vector<int64_t> select_experts(const float* choice, int64_t M, int64_t E, int64_t K, int64_t n_group,
                                    int64_t topk_group) {
  std::vector<int64_t> out(static_cast<size_t>(M * K));
  const int64_t gsize = E / n_group;
  parallel_for(M, 16, [&](int64_t s, int64_t e) {
    std::vector<int64_t> cand(static_cast<size_t>(E)), groups(static_cast<size_t>(n_group));
    std::vector<float> gscore(static_cast<size_t>(n_group));
    for (int64_t m = s; m < e; ++m) {
      const float* c = choice + m * E;
      int64_t n = 0;
      if (n_group > 1 && topk_group < n_group) {
        for (int64_t g = 0; g < n_group; ++g) gscore[size_t(g)] = moe_group_score(c, g * gsize, (g + 1) * gsize);
        std::iota(groups.begin(), groups.end(), 0);
        std::partial_sort(groups.begin(), groups.begin() + topk_group, groups.end(), ByScore{gscore.data()});
        std::sort(groups.begin(), groups.begin() + topk_group);
        for (int64_t gi = 0; gi < topk_group; ++gi)
          for (int64_t j = groups[size_t(gi)] * gsize; j < (groups[size_t(gi)] + 1) * gsize; ++j) cand[size_t(n++)] = j;
      } else {
        std::iota(cand.begin(), cand.end(), 0);
        n = E;
      }
      std::partial_sort(cand.begin(), cand.begin() + K, cand.begin() + n, ByScore{c});
      std::copy(cand.begin(), cand.begin() + K, out.begin() + m * K);
    }
  });
  return out;
}

MoE::MoE(const MoeOptions& options) : opts(options) {
  validate(opts);
  const int64_t D = opts.d_model, E = opts.n_experts;
  router = Linear(D, E, Bias::None);
  if (opts.bias == SelectionBias::Present) {
    router_bias = parameter({E});
    router_bias->requires_grad = false;  // moved by apply_bias_update, never by gradients (§8.1 step 2)
  }
  const int64_t width = opts.latent_dim > 0 ? opts.latent_dim : D;
  experts.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) experts.emplace_back(width, opts.expert_hidden, glu_options(opts, opts.names.expert));
  if (opts.n_shared > 0)
    shared.emplace(D, opts.shared_hidden > 0 ? opts.shared_hidden : opts.n_shared * opts.expert_hidden,
                   glu_options(opts, opts.names.shared_glu));
  if (opts.shared_gate == SharedGate::Sigmoid) {
    if (opts.n_shared <= 0) throw error("moe", "a shared-expert gate without a shared expert");
    shared_gate = Linear(D, 1, Bias::None);
  }
  if (opts.latent_dim > 0) {
    latent_down = Linear(D, opts.latent_dim, Bias::None);
    latent_up = Linear(opts.latent_dim, D, Bias::None);
    if (opts.latent_norm == LatentNorm::RMSNorm) latent_norm.emplace(NormType::RMSNorm, opts.latent_dim, opts.norm_eps);
  }
  rows_processed_.assign(static_cast<size_t>(E), 0);
  acc_load_.assign(static_cast<size_t>(E), 0);
}

std::vector<int64_t> MoE::route(const Tensor& scores) const {
  const int64_t M = scores.dim(0), E = opts.n_experts;
  if (fixed_.empty()) return moe::select(scores, router_bias ? router_bias->value : Tensor(), opts.top_k, opts.n_group,
                                         opts.topk_group);
  if (static_cast<int64_t>(fixed_.size()) != M * opts.top_k)
    throw error("moe", "fixed routing has ", fixed_.size(), " indices for ", M, " tokens × top-", opts.top_k);
  for (int64_t e : fixed_)
    if (e < 0 || e >= E) throw error("moe", "fixed routing names expert ", e, " of ", E);
  return fixed_;
}

Var MoE::forward(const Var& x) const {
  const Tensor& X = x->value;
  if (X.ndim() != 2 || X.dim(1) != opts.d_model)
    throw error("moe", "input ", X.describe(), " is not [tokens, ", opts.d_model, "]");

  // Router in fp32 on the full-width x (§8.1 step 1, §8.2 step 1).
  std::optional<profile::Scope> scope(std::in_place, "router");
  Var logits = router(x);  // [M, E]
  Var scores = opts.score == ScoreFunction::Sigmoid ? ag::sigmoid(logits) : ag::softmax_last(logits);  // [M, E]
  const Tensor offset = opts.combine == CombineWeights::Biased && router_bias ? router_bias->value : Tensor();
  Var r;  // [M, ℓ] or [M, D]
  if (moe::has_dense_form(X) && !recording() && fixed_.empty() && runs_dense(X.dim(0)))
    r = routed_dense(x, scores, offset, scope);
  if (!r) r = routed_rows(x, scores, offset, scope);
  if (opts.latent_dim > 0) {
    if (latent_norm) r = (*latent_norm)(r);
    r = latent_up(r);  // [M, D]
  }
  scope.emplace("shared experts");
  if (shared) {  // shared experts on the full x
    Var y = shared->forward(x);
    if (shared_gate.weight) y = ag::mul(y, ag::broadcast_heads(ag::sigmoid(shared_gate(x)), opts.d_model));
    r = ag::add(r, y);
  }
  scope.reset();
  last_scores_ = scores;
  return r;
}

Var MoE::routed_dense(const Var& x, const Var& scores, const Tensor& offset,
                      std::optional<profile::Scope>& scope) const {
  const int64_t M = x->value.dim(0), K = opts.top_k;
  // Every expert on every row, the ids kept on the device (kDenseRows).
  moe::DenseRouting dr =
      moe::dense_routing(scores->value, router_bias ? router_bias->value : Tensor(), offset, K, opts.n_group,
                         opts.topk_group, opts.renormalize == Renormalize::Yes, opts.renorm_eps, opts.routed_scaling);
  scope.emplace("routed experts");
  Var xr = opts.latent_dim > 0 ? latent_down(x) : x;
  Var r = constant(moe::dense_experts(xr->value, dr.dense, experts));
  // Bookkeeping: the ids and weights come to the host when last_routing() asks.
  std::fill(rows_processed_.begin(), rows_processed_.end(), M);
  last_ = Routing{};
  last_.tokens = M;
  last_.top_k = K;
  last_weights_ = std::move(dr.weights);
  weights_pending_ = true;
  last_ids_ = std::move(dr.ids);
  ids_pending_ = true;
  return r;
}

Var MoE::routed_rows(const Var& x, const Var& scores, const Tensor& offset,
                     std::optional<profile::Scope>& scope) const {
  const int64_t M = x->value.dim(0), E = opts.n_experts, K = opts.top_k;
  // Selection runs where the scores are; the ids come to the host, which builds the dispatch lists.
  std::vector<int64_t> idx = route(scores->value);  // [M·K]

  Var w = ag::gather_cols(scores, idx, K, offset);  // [M, K]
  if (opts.renormalize == Renormalize::Yes) w = ag::normalize_sum_last(w, opts.renorm_eps);
  if (opts.routed_scaling != 1.0f) w = ag::scale(w, opts.routed_scaling);

  // Dispatch: each active expert runs on its own rows only.
  const ag::Dispatch d = ag::make_dispatch(idx, M, K, E);
  scope.emplace("routed experts");
  Var xr = opts.latent_dim > 0 ? latent_down(x) : x;  // [M, ℓ] or [M, D]
  std::fill(rows_processed_.begin(), rows_processed_.end(), 0);
  for (int64_t j = 0; j < d.active(); ++j)
    rows_processed_[size_t(d.experts[size_t(j)])] += d.offsets[size_t(j + 1)] - d.offsets[size_t(j)];
  Var r;
  // Inference: all experts in one pass where the device has that form; training takes the
  // per-expert ops below, which have a backward.
  bool train = recording() && (needs_grad(xr) || needs_grad(w));
  if (recording() && !train)  // frozen input and router, trainable experts
    for (const auto& e : experts) e.visit("", [&](const std::string&, Node& p, ParamKind) { train |= p.requires_grad; });
  if (!train)
    if (std::optional<Tensor> fused = moe::routed_experts(xr->value, d, w->value, experts, M)) r = constant(std::move(*fused));
  if (!r) {
    std::vector<Var> ys;
    ys.reserve(static_cast<size_t>(d.active()));
    for (int64_t j = 0; j < d.active(); ++j)
      ys.push_back(experts[size_t(d.experts[size_t(j)])].forward(ag::gather_rows(xr, d.rows_of(j))));  // [n_e, width]
    r = ag::weighted_combine(ys, d, w, M);  // [M, width]
  }

  // Bookkeeping for inspection and balancing.
  last_.tokens = M;
  last_.top_k = K;
  last_weights_ = w->value;
  weights_pending_ = true;
  ids_pending_ = false;
  last_ids_ = device::Buffer();
  last_.load.assign(static_cast<size_t>(E), 0);
  for (int64_t e : idx) ++last_.load[size_t(e)];
  if (recording())
    for (int64_t e = 0; e < E; ++e) acc_load_[size_t(e)] += last_.load[size_t(e)];
  last_.indices = std::move(idx);
  return r;
}

bool MoE::runs_dense(int64_t M) const {
  const int64_t E = opts.n_experts;
  if (experts.empty() || M * E > kDenseRows || is_block_dtype(experts[0].gate.weight->value.dtype())) return false;
  double expert_bytes = 0;
  for (const Linear* l : {&experts[0].gate, &experts[0].up, &experts[0].down}) expert_bytes += double(l->weight->value.nbytes());
  return double(std::max<int64_t>(E - M * opts.top_k, 0)) * expert_bytes <= kDenseExtraBytes;
}

const Routing& MoE::last_routing() const {
  if (ids_pending_) {
    last_.indices.assign(size_t(last_.tokens * last_.top_k), 0);
    device::download(last_.indices.data(), last_ids_.get(), last_.indices.size() * sizeof(int64_t));
    last_ids_ = device::Buffer();
    ids_pending_ = false;
    last_.load.assign(static_cast<size_t>(opts.n_experts), 0);
    for (int64_t e : last_.indices) ++last_.load[size_t(e)];
  }
  if (weights_pending_) {
    const Tensor wh = last_weights_.to_device(Device::CPU);
    last_.weights.assign(wh.f32(), wh.f32() + wh.numel());
    last_weights_ = Tensor();
    weights_pending_ = false;
  }
  return last_;
}

void MoE::apply_bias_update(float gamma) {
  apply_bias_update(gamma, acc_load_);
  std::fill(acc_load_.begin(), acc_load_.end(), 0);
}

void MoE::apply_bias_update(float gamma, const std::vector<int64_t>& load) {
  if (!router_bias) throw error("moe", "the bias update needs a router with e_score_correction_bias");
  const int64_t E = opts.n_experts;
  if (static_cast<int64_t>(load.size()) != E) throw error("moe", "load has ", load.size(), " entries for ", E, " experts");
  if (!router_bias->value.has_storage()) router_bias->value = Tensor::zeros({E});
  const double mean = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0})) / double(E);
  const Device dev = router_bias->value.device();
  Tensor host = dev == Device::CPU ? router_bias->value : router_bias->value.to_device(Device::CPU);
  float* b = host.f32();
  for (int64_t e = 0; e < E; ++e) {
    const double diff = mean - double(load[size_t(e)]);
    b[e] += gamma * static_cast<float>((diff > 0) - (diff < 0));  // underloaded up, overloaded down
  }
  if (dev != Device::CPU) router_bias->value = host.to_device(dev);
}

Var MoE::balance_loss(int64_t seq_len, float alpha) const {
  if (!last_scores_) throw error("moe", "balance_loss needs a forward first");
  last_routing();  // the ids, where the last forward kept them on the device
  return ag::seq_balance_loss(last_scores_, last_.indices, opts.top_k, seq_len, alpha);
}

void MoE::visit(const std::string& prefix, const ParamVisitor& v) const {
  const std::string rp = join_name(prefix, opts.names.router);
  router.visit(rp, v);
  if (router_bias) v(join_name(rp, "e_score_correction_bias"), *router_bias, ParamKind::Other);
  const std::string ep = join_name(prefix, opts.names.experts);
  for (size_t e = 0; e < experts.size(); ++e) experts[e].visit(join_name(ep, std::to_string(e)), v);
  if (shared) shared->visit(join_name(prefix, opts.names.shared), v);
  if (shared_gate.weight) shared_gate.visit(join_name(prefix, opts.names.shared_gate), v);
  if (opts.latent_dim > 0) {
    latent_down.visit(join_name(prefix, opts.names.latent_down), v);
    latent_up.visit(join_name(prefix, opts.names.latent_up), v);
    if (latent_norm) latent_norm->visit(join_name(prefix, opts.names.latent_norm), v);
  }
}

int64_t MoE::active_params() const {
  int64_t n = router.params() + (router_bias ? opts.n_experts : 0);
  n += opts.top_k * experts.front().active_params();
  if (shared) n += shared->active_params() + (shared_gate.weight ? opts.d_model : 0);
  if (opts.latent_dim > 0) n += latent_down.params() + latent_up.params() + (latent_norm ? opts.latent_dim : 0);
  return n;
}

int64_t MoE::total_params() const {
  return active_params() + (opts.n_experts - opts.top_k) * experts.front().active_params();
}

}  // namespace k3
