#include "mixers/softmax_attention.h"

#include <cmath>

namespace k3 {

SoftmaxAttention::SoftmaxAttention(const SoftmaxAttentionOptions& o)
    : c_attn(o.d_model, 3 * o.d_model, Bias::Present, o.layout),
      c_proj(o.d_model, o.d_model, Bias::Present, o.layout),
      o_(o),
      hd_(o.d_model / o.heads) {
  K3_CHECK(o.d_model % o.heads == 0, "d_model ", o.d_model, " not divisible by heads ", o.heads);
}

void SoftmaxAttention::forward(const float* x, int64_t T, float* y, Memory* memory, Arena& arena) const {
  const int64_t D = o_.d_model, H = o_.heads;
  Tensor qkv = arena.alloc({T, 3 * D});  // [T, 3D] = q | k | v
  c_attn.forward(x, T, qkv.f32());
  Tensor att = arena.alloc({T, D});  // [T, H, hd]
  float* base = qkv.f32();
  HeadView q{base, 3 * D, hd_}, k{base + D, 3 * D, hd_}, v{base + 2 * D, 3 * D, hd_};
  HeadView out{att.f32(), D, hd_};
  AttentionShape s{T, T, H, hd_, 0, 1.0f / std::sqrt(float(hd_))};
  if (memory) {
    auto* cache = static_cast<KVCache*>(memory);
    s.pos0 = cache->length();
    cache->append(k, v, T);
    s.S = cache->length();
    attention_forward(q, cache->keys(), cache->values(), out, s);
  } else {
    if (T > o_.max_positions)
      throw error("attention", "sequence of ", T, " tokens exceeds the model's ", o_.max_positions, " positions");
    attention_forward(q, k, v, out, s);
  }
  c_proj.forward(att.f32(), T, y);
}

std::unique_ptr<Memory> SoftmaxAttention::new_memory(int64_t max_tokens) const {
  return std::make_unique<KVCache>(o_.heads, hd_, std::min(max_tokens, o_.max_positions));
}

std::vector<MemorySpec> SoftmaxAttention::memory_spec() const {
  return {{MemoryKind::KVCache, double(2 * o_.d_model * sizeof(float)), 0}};
}

void SoftmaxAttention::visit(const std::string& prefix, const ParamVisitor& v) {
  c_attn.visit(join_name(prefix, "c_attn"), v);
  c_proj.visit(join_name(prefix, "c_proj"), v);
}

}  // namespace k3
