// Rotary position embedding (spec §6): pairs of the rotated columns turn by pos·θ_i,
// θ_i = base^(-2i/d). DeepSeek's pairs are adjacent (x[2i], x[2i+1]): HF's rope_interleave
// permutes q and k the same way before a rotate-half, so every q·k product is identical. Llama's
// and Qwen's rotate-half pairs x[i] with x[i + d/2] (RopeTable::half_pairs). YaRN (transformers'
// _compute_yarn_parameters) changes θ_i and scales cos/sin by an attention factor.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace k3 {

struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;
  std::optional<double> attention_factor;
};

struct RopeTable {
  int64_t dim = 0;                 // rotated dims (even)
  std::vector<double> inv_freq;    // [dim / 2]
  double attention_factor = 1.0;   // multiplies cos and sin (YaRN)
  bool half_pairs = false;         // pairs (i, i + dim/2) (rotate-half) instead of (2i, 2i + 1)
  void angles(int64_t pos, std::vector<float>& cos, std::vector<float>& sin) const;
};

RopeTable make_rope(int64_t dim, double theta, const std::optional<YarnScaling>& yarn = std::nullopt);
// YaRN's mscale: 0.1·m·ln(factor) + 1 for factor > 1, else 1.
double yarn_mscale(double factor, double m);

// In place on rows x[M, H*hd]: rotates columns [offset, offset + table.dim) of every head at
// row m by positions[m], paired as the table says. `direction` -1 applies the inverse rotation (the backward pass).
void rope_apply(float* x, int64_t M, int64_t H, int64_t hd, int64_t offset, const int64_t* positions,
                const RopeTable& table, int direction);

}  // namespace k3
