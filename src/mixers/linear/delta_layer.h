// One mixer for the whole gated delta-rule family (spec §2–5, §11; oracles.md §1.5, §3.2):
// linear attention, DeltaNet, Gated DeltaNet and KDA (Kimi-Linear, Kimi K3), configured by
// DeltaLayerOptions (never by tensor shapes). Parameters are named as the checkpoints name them
// (DeltaNaming). Memory: RecurrentState (state + conv tails).
//
//   q = [l2norm] [φ] [SiLU] [conv] q_proj x        k likewise        v = [SiLU] [conv] v_proj x
//   β = sigmoid(b_proj x)                                            (DeltaNet, GDN, KDA)
//   g = −exp(A_log)·softplus(a_proj x + dt_bias)                      (GDN, one per value head)
//   g = KDA gate(f_b(f_a x) + dt_bias) softplus or lower-bound form   (KDA, per channel)
//   o = core(q, k, v, β, g);  y = o_proj( RMSNorm_head(o) · act(gate) )
#pragma once

#include "mixers/linear/ag_delta.h"
#include "mixers/linear/recurrent_state.h"
#include "mixers/mixer.h"
#include "ops/ag_norms.h"
#include "ops/linear.h"

namespace k3 {

enum class DeltaKind : uint8_t { LinearAttention, DeltaNet, GatedDeltaNet, Kda };
// KimiHF: Kimi-Linear / K3 checkpoints (f_a_proj, f_b_proj, g_a_proj, g_b_proj, g_proj).
// Fla: flash-linear-attention's layers (KDA: f_proj.0/1, g_proj.0/1 with a bias on g_proj.1;
// LinearAttention's output norm is `norm`).
// Qwen3Next: Qwen3-Next's Gated DeltaNet, its projections fused as transformers stores them:
// in_proj_qkvz [H·(2K + 2·(HV/H)·V), D] grouped by key head (each head's q, k, then its value
// heads' v and z), in_proj_ba [H·2·(HV/H), D] likewise (b then a), conv1d over q | k | v,
// norm (the gated RMSNorm's weight), out_proj. The forward slices them per head.
enum class DeltaNaming : uint8_t { KimiHF, Fla, Qwen3Next };
enum class DeltaOutputGate : uint8_t {
  None,
  KimiLowRank,  // sigmoid(g_b_proj(g_a_proj x)) (fla: g_proj.1(g_proj.0 x) + bias)
  FullRank,     // sigmoid(g_proj x) (K3, use_full_rank_gate)
  Swish,        // SiLU(g_proj x) (fla GatedDeltaNet / DeltaNet use_gate)
};
enum class FeatureMap : uint8_t { Identity, Elu1 };
using ag::KdaGateForm;

struct DeltaLayerOptions {
  DeltaKind kind = DeltaKind::Kda;
  DeltaNaming naming = DeltaNaming::KimiHF;
  int64_t d_model = 0;
  int64_t heads = 0;        // q/k heads H
  int64_t value_heads = 0;  // HV (a multiple of H); 0 = heads
  int64_t head_k_dim = 0, head_v_dim = 0;
  int64_t conv_size = 4;      // short conv kernel W; 0 = none
  bool silu = true;           // SiLU on q, k, v after the conv (fla: qk_activation 'silu')
  bool qk_l2norm = true;      // l2norm(q), l2norm(k) per head, eps 1e-6 (fla use_qk_l2norm_in_kernel)
  FeatureMap feature_map = FeatureMap::Identity;  // on q and k (linear attention)
  bool use_beta = true;       // DeltaNet's use_beta; false means β = 1
  // KDA decay gate.
  KdaGateForm gate_form = KdaGateForm::Softplus;
  float gate_lower_bound = -5.0f;
  int64_t gate_rank = 0;      // f_a / f_proj.0 width; 0 = head_v_dim
  Shape a_log_shape;          // stored A_log shape; empty = [HV]. Only the first HV values are read.
  // Output.
  DeltaOutputGate output_gate = DeltaOutputGate::KimiLowRank;
  int64_t output_gate_rank = 0;  // g_a_proj width; 0 = head_v_dim
  bool output_norm = true;       // per-head RMSNorm with a weight [V] shared by the heads
  float norm_eps = 1e-5f;
  // Core.
  int chunk = 16;
  float scale = 0.0f;             // 0 = K^-1/2
  bool normalize = false;         // Katharopoulos normaliser (linear attention only)
  float normalize_eps = 1e-10f;

  int64_t hv() const { return value_heads ? value_heads : heads; }

  // Ready-made configurations (the fields stay editable afterwards).
  static DeltaLayerOptions kimi_linear_kda(int64_t d_model, int64_t heads, int64_t head_dim, float eps);
  static DeltaLayerOptions kimi_k3_kda(int64_t d_model, int64_t heads, int64_t head_dim, float eps);
  static DeltaLayerOptions fla_linear_attention(int64_t d_model, int64_t heads, int64_t head_k_dim, int64_t head_v_dim);
  static DeltaLayerOptions fla_delta_net(int64_t d_model, int64_t heads, int64_t head_dim, bool use_gate = false);
  static DeltaLayerOptions fla_gated_delta_net(int64_t d_model, int64_t heads, int64_t value_heads, int64_t head_k_dim,
                                               int64_t head_v_dim);
  static DeltaLayerOptions qwen3_next_gdn(int64_t d_model, int64_t heads, int64_t value_heads, int64_t head_k_dim,
                                          int64_t head_v_dim, int64_t conv_size, float eps);
};

class DeltaLayer final : public Mixer {
 public:
  explicit DeltaLayer(const DeltaLayerOptions& o);
  Var forward(const Var& x, const SeqBatch& batch) const override;
  std::unique_ptr<Memory> new_memory(int64_t max_tokens) const override;
  std::vector<MemorySpec> memory_spec() const override;
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  std::string_view name() const override;
  const DeltaLayerOptions& options() const { return o_; }
  linear::DeltaOptions core_options() const;

 private:
  Var conv(const Var& x, const Var& w, const SeqBatch& batch) const;
  struct ConvWeights {
    Var q, k, v;
  };
  ConvWeights conv_weights() const;  // the three streams' (rows of the fused one under Qwen3Next)
  Var core(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const SeqBatch& batch) const;

  DeltaLayerOptions o_;
  int64_t H_, HV_, K_, V_;
  Linear q_proj_, k_proj_, v_proj_, b_proj_, a_proj_, f_a_proj_, f_b_proj_, g_a_proj_, g_b_proj_, g_proj_, o_proj_;
  Linear in_proj_qkvz_, in_proj_ba_;  // Qwen3Next
  Var q_conv_, k_conv_, v_conv_, qkv_conv_, A_log_, dt_bias_, o_norm_;
};

}  // namespace k3
