// Mixture of experts (spec §8): DeepSeek-V3 / Kimi sigmoid routing with bias-corrected grouped
// top-k selection ("noaux_tc", §8.1), routed SiLU/SiTU GLU experts, shared experts, and K3's
// Stable LatentMoE (§8.2): the routed path runs in a latent width ℓ between
// routed_expert_down_proj (D → ℓ) and routed_expert_up_proj (ℓ → D), with an optional RMSNorm.
//
// Dispatch/combine cost is proportional to tokens × top-k: token rows are grouped by expert
// (ag::make_dispatch), each active expert runs on its own rows only, and a weighted scatter-add
// puts the results back (ag::weighted_combine). Gradients reach the experts and, through the
// combine weights, the router; the selection itself is not differentiable. The routing weight
// multiplies each expert's output after W2 (spec §12 item 8: equal to NeMo's before-W2 form up to
// rounding). forward() updates routing bookkeeping (mutable): one forward at a time per module.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/profile.h"
#include "ffn/glu.h"
#include "ops/ag_moe.h"

namespace k3 {

enum class ScoreFunction : uint8_t { Sigmoid, Softmax };
// Whether the router has gate.e_score_correction_bias (added to the scores for selection only).
enum class SelectionBias : uint8_t { None, Present };
// Which scores the combine weights are read from (spec §8.1 step 6, §12 item 5):
//  Unbiased: s[idx], the DeepSeek-V3 / vLLM / K3 / transformers semantics.
//  Biased:   s[idx] + b[idx]. The Kimi-Linear remote-code modeling_kimi.py does
//            `scores_for_choice = scores.view(...); scores_for_choice += bias`, an in-place add on
//            a view, so its later `scores.gather(...)` reads the bias-corrected scores. Only for
//            bit-parity with that file; the kimi-linear-tiny fixture (transformers) is Unbiased.
enum class CombineWeights : uint8_t { Unbiased, Biased };
enum class Renormalize : uint8_t { No, Yes };  // norm_topk_prob / moe_renormalize
enum class LatentNorm : uint8_t { None, RMSNorm };  // latent_moe_use_norm

// Hugging Face sub-names under the module prefix.
struct MoeNames {
  std::string router = "gate";              // gate.weight, gate.e_score_correction_bias
  std::string experts = "experts";          // experts.{e}.<expert.gate|up|down>.weight
  std::string shared = "shared_experts";    // shared_experts.<shared_glu...>.weight
  std::string shared_gate = "shared_expert_gate";  // shared_expert_gate.weight [1, D] (SharedGate::Sigmoid)
  GluNames expert = GluNames::hf();
  GluNames shared_glu = GluNames::hf();
  std::string latent_down = "routed_expert_down_proj";
  std::string latent_up = "routed_expert_up_proj";
  std::string latent_norm = "routed_expert_norm";

  static MoeNames deepseek() { return {}; }  // mlp.experts.{e}.{gate,up,down}_proj
  static MoeNames kimi() {                   // block_sparse_moe.experts.{e}.{w1,w2,w3}
    MoeNames n;
    n.expert = GluNames::kimi_expert();
    return n;
  }
  static MoeNames qwen3_next() {  // mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_expert, mlp.shared_expert_gate
    MoeNames n;
    n.shared = "shared_expert";
    return n;
  }
};
// Qwen3-Next scales its shared expert's output per token by sigmoid(shared_expert_gate · x).
enum class SharedGate : uint8_t { None, Sigmoid };

struct MoeOptions {
  int64_t d_model = 0;
  int64_t n_experts = 0;      // n_routed_experts / num_experts
  int64_t top_k = 0;          // num_experts_per_tok / num_experts_per_token
  int64_t expert_hidden = 0;  // moe_intermediate_size
  int64_t n_shared = 0;       // shared GLU width = n_shared · expert_hidden; 0: no shared experts
  int64_t shared_hidden = 0;  // the shared GLU's width where it is set (shared_expert_intermediate_size)
  SharedGate shared_gate = SharedGate::None;
  int64_t n_group = 1, topk_group = 1;  // n_group / num_expert_group, topk_group
  float routed_scaling = 1.0f;          // routed_scaling_factor
  ScoreFunction score = ScoreFunction::Sigmoid;
  SelectionBias bias = SelectionBias::Present;
  CombineWeights combine = CombineWeights::Unbiased;
  Renormalize renormalize = Renormalize::Yes;
  float renorm_eps = 1e-20f;
  int64_t latent_dim = 0;  // routed_expert_hidden_size; 0: plain (full-width) MoE
  LatentNorm latent_norm = LatentNorm::None;
  float norm_eps = 1e-5f;  // rms_norm_eps of the latent RMSNorm
  GluActivation activation = GluActivation::SiLU;
  SituOptions situ;
  MoeNames names;
};

// The routing of the last forward, for tests, logging and load balancing.
struct Routing {
  int64_t tokens = 0, top_k = 0;
  std::vector<int64_t> indices;  // [M·K] selected experts, per token by descending choice score
  std::vector<float> weights;    // [M·K] combine weights (after renormalisation and scaling)
  std::vector<int64_t> load;     // [E] tokens routed to each expert
};

// Grouped top-k selection (spec §8.1 steps 4–5) on choice scores [M, E] (= scores + bias).
// Group score = sum of the top-2 choice scores in the group; the best topk_group groups stay;
// then the top-k experts among them. Ties go to the lower index (torch.topk leaves tie order
// unspecified). Returns [M·K] expert ids.
std::vector<int64_t> select_experts(const float* choice, int64_t M, int64_t E, int64_t K, int64_t n_group,
                                    int64_t topk_group);

class MoE final : public Ffn {
 public:
  explicit MoE(const MoeOptions& options);
  Var forward(const Var& x) const override;  // x [M, D] -> [M, D]
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  int64_t active_params() const override;
  int64_t total_params() const;

  // The combine weights are copied to the host here, on first ask, not in forward: on CUDA that
  // copy would be one more device sync per MoE layer on the decode path.
  const Routing& last_routing() const;
  // Rows each expert's GLU actually processed in the last forward [E]: last_routing().load, or M
  // for every expert where the decode ran every expert on every row (below).
  const std::vector<int64_t>& rows_processed() const { return rows_processed_; }

  // On CUDA without a graph, batches of M tokens with M · E ≤ kDenseRows run every expert on every
  // row and keep what the routing weights pick: no ids come back to the host, so the step queues
  // on without waiting for the device (the small-batch decode). Only where the weights of the
  // experts no row can have picked (at least E − M·K of them) total ≤ kDenseExtraBytes: reading
  // them costs about what the wait would. (At M·K ≥ E the expert work grows E/K-fold instead;
  // kDenseRows bounds it.)
  static constexpr int64_t kDenseRows = 4096;
  static constexpr double kDenseExtraBytes = 64.0 * (1 << 20);
  bool runs_dense(int64_t M) const;

  // Forces the selected experts (indices [M·K], for finite-difference tests); the combine weights
  // are still computed from the router, so gradients reach it.
  void set_fixed_routing(std::vector<int64_t> indices) { fixed_ = std::move(indices); }
  void clear_fixed_routing() { fixed_.clear(); }

  // Auxiliary-loss-free balancing (DeepSeek-V3): bias_e += γ·sign(mean_load − load_e).
  // Forwards run under ag Recording (training) add their per-expert token counts to
  // accumulated_load(); apply_bias_update(γ) uses and then clears them, so gradient accumulation
  // over micro-batches counts every micro-batch. The second form takes explicit counts.
  const std::vector<int64_t>& accumulated_load() const { return acc_load_; }
  void apply_bias_update(float gamma);
  void apply_bias_update(float gamma, const std::vector<int64_t>& load);

  // DeepSeek-V3 sequence-wise auxiliary balance loss of the last forward, whose M tokens are
  // M / seq_len sequences of seq_len tokens (ag::seq_balance_loss). Call it after the forward and
  // before backward; add α·(this) to the training loss (alpha is folded in here).
  Var balance_loss(int64_t seq_len, float alpha) const;

  MoeOptions opts;
  Linear router;     // gate.weight [E, D]
  Var router_bias;   // gate.e_score_correction_bias [E] (no gradient) or null
  std::vector<GluMlp> experts;
  std::optional<GluMlp> shared;
  Linear shared_gate;  // [1, D] with SharedGate::Sigmoid
  Linear latent_down, latent_up;  // only with latent_dim > 0
  std::optional<Norm> latent_norm;

 private:
  std::vector<int64_t> route(const Tensor& scores) const;
  // The routed experts' output [M, ℓ or D] (before the latent up-projection), with the last
  // forward's bookkeeping: every expert on every row (CUDA, runs_dense), or each expert on its
  // rows. `scope` is the forward's profile scope, moved on to "routed experts".
  Var routed_dense(const Var& x, const Var& scores, const Tensor& offset, std::optional<profile::Scope>& scope) const;
  Var routed_rows(const Var& x, const Var& scores, const Tensor& offset, std::optional<profile::Scope>& scope) const;

  std::vector<int64_t> fixed_;
  mutable Routing last_;
  mutable Tensor last_weights_;  // [M, K] on the model's device until last_routing() asks
  mutable bool weights_pending_ = false;
  mutable device::Buffer last_ids_;  // [M·K] int64 on the device (the dense form) until last_routing() asks
  mutable bool ids_pending_ = false;
  mutable Var last_scores_;
  mutable std::vector<int64_t> rows_processed_, acc_load_;
};

}  // namespace k3
