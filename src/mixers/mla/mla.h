// Multi-head latent attention (spec §6-§7): DeepSeek-V3's MLA with decoupled RoPE, Kimi's NoPE
// variant (the rope slice exists, unrotated) and K3's elementwise sigmoid output gate.
// Prefill/training use the expanded form; decode uses weight absorption over a latent cache of
// c_kv (after kv_a_layernorm) + k_rope (after RoPE): kv_lora_rank + qk_rope_head_dim values per
// token per layer.
#pragma once

#include <optional>

#include "mixers/mixer.h"
#include "mixers/token_rows.h"
#include "ops/linear.h"
#include "ops/rope.h"

namespace k3 {

enum class MlaPosition : uint8_t { Rope, NoPE };
enum class OutputGate : uint8_t { None, Sigmoid };

struct MlaOptions {
  int64_t d_model = 0, heads = 0;
  std::optional<int64_t> q_lora_rank;  // null: plain q_proj
  int64_t kv_lora_rank = 512, qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128;
  float latent_norm_eps = 1e-6f;  // q_a_layernorm / kv_a_layernorm (HF KimiRMSNorm default; spec §12.6)
  MlaPosition position = MlaPosition::NoPE;
  double rope_theta = 10000.0;
  std::optional<YarnScaling> yarn;
  OutputGate gate = OutputGate::None;
  int64_t max_positions = 1 << 20;
};

// The latent cache of one sequence for one MLA layer: rows [capacity, kv_lora + rope]
// (mixers/token_rows.h) on the device of the layer that made it; fp32, or on CUDA bf16 when
// latent_storage() says so (half the bytes, rows rounded to nearest even as they are written; the
// absorbed attention reads them exactly).
class LatentCache final : public Memory {
 public:
  LatentCache(int64_t width, int64_t max_tokens, Device device = Device::CPU);
  MemoryKind kind() const override { return MemoryKind::LatentCache; }
  void reset() override { rows_.reset(); }
  std::unique_ptr<Memory> clone() const override;
  std::unique_ptr<Memory> clone_to(Device device) const override;
  void restore(const Memory& snapshot) override;
  size_t bytes() const override { return rows_.bytes(); }
  int64_t length() const override { return rows_.length(); }
  int64_t capacity() const override { return rows_.max_tokens(); }
  void extend_zeros(int64_t n) override { rows_.extend_zeros(n); }
  void set_length(int64_t n) override;
  bool can_truncate() const override { return true; }
  void truncate(int64_t n) override { rows_.truncate(n); }
  void append(const float* rows, int64_t n);  // n host rows of `width`
  const float* data() const { return rows_.f32(0); }
  int64_t width() const { return rows_.width(0); }
  TokenRows& rows() { return rows_; }
  Device device() const override { return rows_.device(); }
  // Bytes per latent value of the caches made on `device`.
  static size_t value_bytes(Device device);

 private:
  TokenRows rows_;
};

// The dtype of the latent caches that MLA layers on CUDA make from now on (new_memory): F32 unless
// set; host caches are always fp32. LatentStorage sets it for a scope.
void set_latent_storage(DType dtype);
DType latent_storage();
class LatentStorage {
 public:
  explicit LatentStorage(DType dtype) : saved_(latent_storage()) { set_latent_storage(dtype); }
  ~LatentStorage() { set_latent_storage(saved_); }
  LatentStorage(const LatentStorage&) = delete;
  LatentStorage& operator=(const LatentStorage&) = delete;

 private:
  DType saved_;
};

class Mla final : public Mixer {
 public:
  explicit Mla(const MlaOptions& o);
  Var forward(const Var& x, const SeqBatch& batch) const override;
  std::unique_ptr<Memory> new_memory(int64_t max_tokens) const override;
  std::vector<MemorySpec> memory_spec() const override;
  void visit(const std::string& prefix, const ParamVisitor& v) const override;
  std::string_view name() const override { return "mla"; }
  float softmax_scale() const { return scale_; }

 private:
  Var queries(const Var& x, const std::vector<int64_t>& pos) const;  // [M, H*(nope+rope)]
  // The same from x's first query projection (q_a_proj, or q_proj without a q LoRA) made already.
  Var queries_from(const Var& first, const std::vector<int64_t>& pos) const;
  Var absorbed(const Var& x, const SeqBatch& batch) const;           // decode over the cache

  MlaOptions o_;
  Linear q_proj_, q_a_proj_, q_b_proj_, kv_a_proj_, kv_b_proj_, o_proj_, g_proj_;
  Norm q_a_norm_, kv_a_norm_;
  RopeTable rope_;
  float scale_;
};

}  // namespace k3
