// Gated MLP (GLU) of DeepSeek-V3 / Kimi / K3: y = down( act(gate(x), up(x)) ), no biases.
// act is SiLU-GLU (SiLU(gate)·up) or SiTU (spec §9). Used as the dense FFN, as each routed
// expert and as the shared experts of a MoE (spec §8.1 step 9).
#pragma once

#include <string>

#include "ffn/ffn.h"
#include "ops/linear.h"
#include "ops/situ.h"

namespace k3 {

enum class GluActivation : uint8_t { SiLU, SiTU };

// Hugging Face sub-names of the three projections.
struct GluNames {
  std::string gate = "gate_proj", up = "up_proj", down = "down_proj";

  static GluNames hf() { return {}; }                      // DeepSeek/K3 dense MLP, shared experts
  static GluNames kimi_expert() { return {"w1", "w3", "w2"}; }  // Kimi routed experts: w1 gate, w3 up, w2 down
};

struct GluOptions {
  GluActivation activation = GluActivation::SiLU;
  SituOptions situ;  // read only for SiTU
  GluNames names;
};

class GluMlp final : public Ffn {
 public:
  GluMlp(int64_t d_model, int64_t hidden, const GluOptions& opts);
  Var forward(const Var& x) const override;  // x [M, D] -> [M, D]
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  int64_t active_params() const override { return gate.params() + up.params() + down.params(); }

  // The activation alone: act(gate, up) [M, hidden].
  Var activate(const Var& g, const Var& u) const;

  GluOptions opts;
  Linear gate, up, down;  // D -> hidden, D -> hidden, hidden -> D
};

}  // namespace k3
