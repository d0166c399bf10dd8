// GPT-2 forward on CUDA (gpt2_cuda.h). Per layer, on M = B·T rows:
//   h = LN1(x); qkv = h Wa + ba; (q, k, v) = split; y = causal_attention(q, k, v);
//   x += y Wp + bp; h = LN2(x); f = gelu(h Wfc + bfc); x += f Wp2 + bp2
// then logits = LNf(x) wteᵀ. Weights are HF Conv1D [in, out] (row-major: y = x W).
#include <cmath>
#include <map>
#include <string>

#include "core/cuda_util.cuh"
#include "models/gpt2_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::cuda {

struct Gpt2Runner::Impl {
  Gpt2Config c;
  device::Storage st;
  std::map<std::string, device::Buffer> w;  // by parameter name

  const float* f(const std::string& name) const { return at(name).as<float>(); }
  const void* g(const std::string& name) const { return at(name).get(); }
  const device::Buffer& at(const std::string& name) const {
    auto it = w.find(name);
    if (it == w.end()) throw error("gpt2 cuda", "no parameter named ", name, " in the model");
    return it->second;
  }
};

Gpt2Runner::Gpt2Runner(const Gpt2Model& model, device::Storage weights) : impl_(std::make_unique<Impl>()) {
  device::require_cuda("gpt2 cuda");
  impl_->c = model.config();
  impl_->st = weights;
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    const Tensor t = p.value.to(DType::F32);
    // GEMM weights (2-D, not the embeddings) take the weight storage; the rest stays fp32. The
    // tied LM head reads wte as a GEMM operand too: keep an extra copy in the weight storage.
    const bool gemm = t.ndim() == 2 && name.find(".weight") != std::string::npos && name.rfind("wte", 0) != 0 &&
                      name.rfind("wpe", 0) != 0;
    impl_->w.emplace(name, device::upload_values(t.f32(), t.numel(), gemm ? weights : device::Storage::F32));
    if (name == "wte.weight") impl_->w.emplace("lm_head", device::upload_values(t.f32(), t.numel(), weights));
  });
}

Gpt2Runner::~Gpt2Runner() = default;

std::vector<float> Gpt2Runner::logits(const int64_t* ids_host, int64_t B, int64_t T) {
  const Impl& m = *impl_;
  const Gpt2Config& c = m.c;
  if (T < 1 || T > c.n_positions) throw error("gpt2 cuda", "T = ", T, " must be in [1, n_positions = ", c.n_positions, "]");
  const int64_t M = B * T, D = c.n_embd, H = c.n_head, hd = D / H, F = c.n_inner.value_or(4 * D), V = c.vocab_size;
  const float eps = float(c.layer_norm_epsilon);
  const bool bf16 = m.st == device::Storage::BF16;
  using device::Buffer;
  std::vector<int64_t> pos(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) pos[size_t(i)] = i % T;
  Buffer ids = device::upload_new(ids_host, size_t(M) * 8), gpos = device::upload_new(pos.data(), pos.size() * 8);
  Buffer x(size_t(M * D) * 4), tmp(size_t(M * D) * 4), h(size_t(M * D) * 4), qkv(size_t(M * 3 * D) * 4),
      q(size_t(M * D) * 4), k(size_t(M * D) * 4), v(size_t(M * D) * 4), y(size_t(M * D) * 4), ff(size_t(M * F) * 4),
      ff2(size_t(M * F) * 4), cast_buf(size_t(M * std::max(D, F)) * 2);
  const auto s = device::Storage::F32;
  embedding_forward(m.f("wte.weight"), V, ids.as<int64_t>(), M, D, x.get(), s);
  embedding_forward(m.f("wpe.weight"), c.n_positions, gpos.as<int64_t>(), M, D, tmp.get(), s);
  add_inplace(x.as<float>(), tmp.as<float>(), M * D);
  // out[M, N] (beta = 0: =, 1: +=) = in[M, K] W[K, N] (+ bias added separately).
  auto matmul = [&](const float* in, int64_t K, const std::string& wname, int64_t N, float* out, float beta) {
    const void* a = in;
    if (bf16) {
      cast(in, cast_buf.get(), M * K, m.st);
      a = cast_buf.get();
    }
    gemm(Op::N, Op::N, M, N, K, 1.0f, a, 0, m.g(wname), 0, beta, out, 0, m.st);
  };
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    layernorm_forward(x.get(), m.f(p + "ln_1.weight"), m.f(p + "ln_1.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
    matmul(h.as<float>(), D, p + "attn.c_attn.weight", 3 * D, qkv.as<float>(), 0.0f);
    add_bias(qkv.as<float>(), m.f(p + "attn.c_attn.bias"), M, 3 * D);
    split_qkv(qkv.as<float>(), q.as<float>(), k.as<float>(), v.as<float>(), M, D);
    const AttnShape as{B, T, T, H, hd, hd, 0, 1.0f / std::sqrt(float(hd))};
    attention_forward(q.get(), k.get(), v.get(), y.get(), nullptr, as, s);
    matmul(y.as<float>(), D, p + "attn.c_proj.weight", D, x.as<float>(), 1.0f);
    add_bias(x.as<float>(), m.f(p + "attn.c_proj.bias"), M, D);
    layernorm_forward(x.get(), m.f(p + "ln_2.weight"), m.f(p + "ln_2.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
    matmul(h.as<float>(), D, p + "mlp.c_fc.weight", F, ff.as<float>(), 0.0f);
    add_bias(ff.as<float>(), m.f(p + "mlp.c_fc.bias"), M, F);
    gelu_tanh_forward(ff.get(), ff2.get(), M * F, s);
    matmul(ff2.as<float>(), F, p + "mlp.c_proj.weight", D, x.as<float>(), 1.0f);
    add_bias(x.as<float>(), m.f(p + "mlp.c_proj.bias"), M, D);
  }
  layernorm_forward(x.get(), m.f("ln_f.weight"), m.f("ln_f.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
  Buffer out(size_t(M * V) * 4);
  const void* a = h.get();
  if (bf16) {
    cast(h.as<float>(), cast_buf.get(), M * D, m.st);
    a = cast_buf.get();
  }
  gemm(Op::N, Op::T, M, V, D, 1.0f, a, 0, m.g("lm_head"), 0, 0.0f, out.as<float>(), 0, m.st);  // h wteᵀ
  std::vector<float> logits(static_cast<size_t>(M * V));
  device::download(logits.data(), out.get(), logits.size() * 4);
  return logits;
}

}  // namespace k3::cuda
