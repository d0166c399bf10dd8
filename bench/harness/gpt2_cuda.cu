// GPT-2 forward on CUDA (gpt2_cuda.h). Per layer, on M = B·T rows:
//   h = LN1(x); qkv = h Wa + ba; (q, k, v) = split; y = causal_attention(q, k, v);
//   x += y Wp + bp; h = LN2(x); f = gelu(h Wfc + bfc); x += f Wp2 + bp2
// then logits = LNf(x) wteᵀ. Weights are HF Conv1D [in, out] (row-major: y = x W).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_util.cuh"
#include "bench/harness/gpt2_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::cuda {

static void check_ids(const int64_t* ids, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw error("gpt2 cuda", "token id ", ids[i], " is outside the vocabulary [0, ", vocab, ")");
}

struct Gpt2Runner::Impl {
  Gpt2Config c;
  device::Storage st;
  std::map<std::string, device::Buffer> w;  // by parameter name
  // Training state (fp32 weights only): gradients and AdamW moments by parameter name.
  // The gradients live in one array (one memset clears them); grad maps names into it.
  device::Buffer grads;
  std::map<std::string, float*> grad;
  std::map<std::string, device::Buffer> m1, m2;
  std::unique_ptr<AdamWGroup> adam;  // every parameter's AdamW step, one launch
  float adam_decay = 0.0f;            // the weight decay the group was made with
  std::map<std::string, bool> decay;
  std::map<std::string, int64_t> numel;
  int64_t step = 0;
  bool bf16_gemms = false;  // train_step's GEMM operands in bf16
  // Under bf16 GEMMs: the GEMM weights' bf16 copies, kept across steps. AdamW writes them as it
  // updates the weights; wb_fresh says they match the fp32 weights (else a step casts them first).
  std::vector<std::string> gemm_weights;
  std::map<std::string, device::Buffer> wb;
  bool wb_fresh = false, adam_bf16 = false;
  float* gr(const std::string& name) const { return grad.at(name); }

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
  if (model.config().k3_short_conv.value_or(0) > 0)
    throw error("gpt2 cuda", "the fused GPT-2 runner has no short convolution (k3_short_conv); use the generic CUDA path");
  impl_->c = model.config();
  impl_->st = weights;
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    const Tensor t = p.value.to(DType::F32);
    // GEMM weights (2-D, not the embeddings) take the weight storage; the rest stays fp32. The
    // tied LM head reads wte as a GEMM operand too: keep an extra copy in the weight storage.
    const bool gemm = t.ndim() == 2 && name.find(".weight") != std::string::npos && name.rfind("wte", 0) != 0 &&
                      name.rfind("wpe", 0) != 0;
    if (name == "wte.weight") {
      // Rows padded with zeros to a multiple of 64 (llm.c's 50,304 for GPT-2): the three LM-head
      // GEMMs of a training step then have aligned extents (50,257 columns leave cuBLAS only its
      // unaligned kernels). The pad rows get zero gradients and stay zero; lookups and the
      // forward-only head read the first V rows.
      const int64_t V = t.dim(0), D = t.dim(1), Vp = (V + 63) / 64 * 64;
      std::vector<float> padded(size_t(Vp * D), 0.0f);
      std::copy(t.f32(), t.f32() + t.numel(), padded.begin());
      impl_->w.emplace(name, device::upload_values(padded.data(), Vp * D, device::Storage::F32));
      impl_->numel[name] = Vp * D;
      if (weights != device::Storage::F32) impl_->w.emplace("lm_head", device::upload_values(t.f32(), t.numel(), weights));
    } else {
      impl_->w.emplace(name, device::upload_values(t.f32(), t.numel(), gemm ? weights : device::Storage::F32));
      impl_->numel[name] = t.numel();
    }
    if (gemm || name == "wte.weight") impl_->gemm_weights.push_back(name);
    impl_->decay[name] = kind == ParamKind::Weight;
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
  check_ids(ids_host, M, V);
  Buffer ids = device::upload_new(ids_host, size_t(M) * 8), gpos = device::upload_new(pos.data(), pos.size() * 8);
  Buffer x(size_t(M * D) * 4), tmp(size_t(M * D) * 4), h(size_t(M * D) * 4), qkv(size_t(M * 3 * D) * 4),
      q(size_t(M * D) * 4), k(size_t(M * D) * 4), v(size_t(M * D) * 4), y(size_t(M * D) * 4), ff(size_t(M * F) * 4),
      ff2(size_t(M * F) * 4), cast_buf(size_t(M * std::max(D, F)) * 2);
  const auto s = device::Storage::F32;
  // Ids checked on the host and positions < n_positions: the lookups need no flag read back.
  embedding_forward(m.f("wte.weight"), V, ids.as<int64_t>(), M, D, x.get(), s, false);
  embedding_forward(m.f("wpe.weight"), c.n_positions, gpos.as<int64_t>(), M, D, tmp.get(), s, false);
  add_inplace(x.as<float>(), tmp.as<float>(), M * D);
  // out[M, N] (beta = 0: =, 1: +=) = in[M, K] W[K, N] (+ bias, by the GEMM's epilogue).
  auto matmul = [&](const float* in, int64_t K, const std::string& wname, int64_t N, float* out, float beta,
                    const float* bias = nullptr) {
    const void* a = in;
    if (bf16) {
      cast(in, cast_buf.get(), M * K, m.st);
      a = cast_buf.get();
    }
    gemm(Op::N, Op::N, M, N, K, 1.0f, a, 0, m.g(wname), 0, beta, out, 0, m.st, bias);
  };
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    layernorm_forward(x.get(), m.f(p + "ln_1.weight"), m.f(p + "ln_1.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
    matmul(h.as<float>(), D, p + "attn.c_attn.weight", 3 * D, qkv.as<float>(), 0.0f);
    split_qkv_to(qkv.as<float>(), m.f(p + "attn.c_attn.bias"), q.get(), k.get(), v.get(), M, D, s);
    const AttnShape as{B, T, T, H, hd, hd, 0, 1.0f / std::sqrt(float(hd))};
    attention_forward(q.get(), k.get(), v.get(), y.get(), nullptr, as, s);
    matmul(y.as<float>(), D, p + "attn.c_proj.weight", D, x.as<float>(), 1.0f, m.f(p + "attn.c_proj.bias"));
    layernorm_forward(x.get(), m.f(p + "ln_2.weight"), m.f(p + "ln_2.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
    matmul(h.as<float>(), D, p + "mlp.c_fc.weight", F, ff.as<float>(), 0.0f, m.f(p + "mlp.c_fc.bias"));
    gelu_tanh_forward(ff.get(), ff2.get(), M * F, s);
    matmul(ff2.as<float>(), F, p + "mlp.c_proj.weight", D, x.as<float>(), 1.0f, m.f(p + "mlp.c_proj.bias"));
  }
  layernorm_forward(x.get(), m.f("ln_f.weight"), m.f("ln_f.bias"), eps, M, D, h.get(), nullptr, nullptr, s);
  Buffer out(size_t(M * V) * 4);
  const void* a = h.get();
  if (bf16) {
    cast(h.as<float>(), cast_buf.get(), M * D, m.st);
    a = cast_buf.get();
  }
  gemm(Op::N, Op::T, M, V, D, 1.0f, a, 0, m.g(bf16 ? "lm_head" : "wte.weight"), 0, 0.0f, out.as<float>(), 0,
       m.st);  // h wteᵀ
  std::vector<float> logits(static_cast<size_t>(M * V));
  device::download(logits.data(), out.get(), logits.size() * 4);
  return logits;
}

float Gpt2Runner::train_step(const int64_t* ids_host, const int64_t* targets_host, int64_t B, int64_t T, float lr,
                             const Adam& adam) {
  Impl& m = *impl_;
  const Gpt2Config& c = m.c;
  if (m.st != device::Storage::F32) throw error("gpt2 cuda", "training keeps fp32 weights; build the runner with F32");
  if (T < 1 || T > c.n_positions) throw error("gpt2 cuda", "T = ", T, " must be in [1, n_positions = ", c.n_positions, "]");
  const int64_t M = B * T, D = c.n_embd, H = c.n_head, hd = D / H, F = c.n_inner.value_or(4 * D), V = c.vocab_size;
  const int64_t L = c.n_layer;
  const float eps = float(c.layer_norm_epsilon);
  const auto s = device::Storage::F32;
  using device::Buffer;
  if (m.grad.empty()) {
    int64_t total = 0;
    for (const auto& [name, n] : m.numel) total += (n + 3) / 4 * 4;  // each tensor 16-byte aligned
    m.grads = Buffer(size_t(total) * 4);
    int64_t off = 0;
    for (const auto& [name, n] : m.numel) {
      m.grad[name] = m.grads.as<float>() + off;
      off += (n + 3) / 4 * 4;
      m.m1.emplace(name, device::zeros_f32(n));
      m.m2.emplace(name, device::zeros_f32(n));
    }
  }
  if (m.bf16_gemms && m.wb.empty())
    for (const std::string& name : m.gemm_weights) m.wb.emplace(name, device::Buffer(size_t(m.numel.at(name)) * 2));
  // The tensors' table carries each one's decay and, under bf16 GEMMs, its bf16 copy.
  if (!m.adam || adam.weight_decay != m.adam_decay || m.adam_bf16 != m.bf16_gemms) {
    std::vector<AdamWTensor> tensors;
    for (const auto& [name, n] : m.numel) {
      auto copy = m.bf16_gemms ? m.wb.find(name) : m.wb.end();
      tensors.push_back({m.w.at(name).as<float>(), m.gr(name), m.m1.at(name).as<float>(), m.m2.at(name).as<float>(),
                         n, m.decay.at(name) ? adam.weight_decay : 0.0f,
                         copy != m.wb.end() ? copy->second.get() : nullptr});
    }
    m.adam = std::make_unique<AdamWGroup>(tensors);
    m.adam_decay = adam.weight_decay;
    m.adam_bf16 = m.bf16_gemms;
  }
  if (m.bf16_gemms && !m.wb_fresh) {
    for (const std::string& name : m.gemm_weights)
      cast(m.f(name), m.wb.at(name).get(), m.numel.at(name), device::Storage::BF16);
    m.wb_fresh = true;
  }
  device::zero(m.grads.get(), m.grads.bytes());

  std::vector<int64_t> pos(static_cast<size_t>(M));
  int64_t count = 0;
  for (int64_t i = 0; i < M; ++i) {
    pos[size_t(i)] = i % T;
    if (targets_host[i] >= V) throw error("gpt2 cuda", "target ", targets_host[i], " outside the vocabulary");
    count += targets_host[i] >= 0;
  }
  check_ids(ids_host, M, V);
  Buffer ids = device::upload_new(ids_host, size_t(M) * 8), gpos = device::upload_new(pos.data(), pos.size() * 8),
         tgt = device::upload_new(targets_host, size_t(M) * 8);
  auto buf = [](int64_t n) { return Buffer(size_t(n) * 4); };
  // Saved activations, per layer: the block input, both norms' outputs and statistics, q/k/v,
  // the attention output and lse, the block's mid-point, the MLP's pre- and post-GELU values
  // (under bf16 GEMMs the norms', q/k/v's, the attention's and the GELU's outputs and the
  // pre-activation only as bf16: their kernels or GEMMs write them so, and only GEMMs, the
  // attention and the GELU's backward read them). The residual stream is never copied: each
  // GEMM that adds into it writes the next array (x → xm → the next block's x), reading its
  // addend from the previous one.
  struct Saved {
    Buffer x, h1, mu1, rs1, q, k, v, y, lse, xm, h2, mu2, rs2, ff, ff2;
    // Under bf16 GEMMs: the bf16 forms read by attention (q, k and v packed as the projection
    // wrote them) and by both the forward GEMM and the backward's weight-gradient GEMM that read
    // each activation.
    Buffer qkvb, yb, h1b, h2b, ffb, ff2b;
  };
  std::vector<Saved> sv(static_cast<size_t>(L));
  Buffer x_final = buf(M * D), tmp = buf(M * D), qkv = m.bf16_gemms ? Buffer() : buf(M * 3 * D);
  for (Saved& a : sv) a.x = buf(M * D), a.xm = buf(M * D);
  Buffer& x0 = L > 0 ? sv[0].x : x_final;
  // Ids checked on the host and positions < n_positions: the lookups need no flag read back.
  embedding_forward(m.f("wte.weight"), V, ids.as<int64_t>(), M, D, x0.get(), s, false);
  embedding_forward(m.f("wpe.weight"), c.n_positions, gpos.as<int64_t>(), M, D, tmp.get(), s, false);
  add_inplace(x0.as<float>(), tmp.as<float>(), M * D);
  const AttnShape as{B, T, T, H, hd, hd, 0, 1.0f / std::sqrt(float(hd))};
  // A GEMM operand: the fp32 array and, under bf16 GEMMs, its bf16 copy if one was made (an
  // operand read by two GEMMs is cast once; one without a copy is cast for its GEMM).
  struct Operand {
    const float* f;
    const void* b = nullptr;
  };
  const auto bf = device::Storage::BF16;  // round both operands, accumulate in fp32
  auto bf_copy = [&](const float* x, int64_t n) {
    Buffer c;
    if (m.bf16_gemms) {
      c = Buffer(size_t(n) * 2);
      cast(x, c.get(), n, bf);
    }
    return c;
  };
  // out = a b (beta 0) or addend + a b (beta 1; addend null: out itself), + bias; out_b, when
  // given (bf16 GEMMs only), receives the product as bf16 in place of out.
  auto mm = [&](Operand a, Op ta, Operand b, Op tb, int64_t rows, int64_t cols, int64_t inner, float* out,
                float beta, const float* bias = nullptr, const float* addend = nullptr, void* out_b = nullptr) {
    if (!m.bf16_gemms)
      return gemm_out(ta, tb, rows, cols, inner, 1.0f, a.f, 0, b.f, 0, beta, GemmOut{out, s, addend, bias}, 0, s);
    Buffer ab, bb;
    if (!a.b) ab = bf_copy(a.f, rows * inner), a.b = ab.get();
    if (!b.b) bb = bf_copy(b.f, inner * cols), b.b = bb.get();
    const GemmOut o = out_b ? GemmOut{out_b, bf, nullptr, bias} : GemmOut{out, s, addend, bias};
    gemm_out(ta, tb, rows, cols, inner, 1.0f, a.b, 0, b.b, 0, beta, o, 0, bf);
  };
  // Weights under bf16 GEMMs: the copies AdamW keeps (cast above when stale).
  auto W = [&](const std::string& name) {
    Operand o{m.f(name)};
    if (m.bf16_gemms) o.b = m.wb.at(name).get();
    return o;
  };
  // A LayerNorm's output: under bf16 GEMMs only the bf16 copy the GEMMs read (the norm writes it
  // itself; its backward reads the input), else fp32.
  auto bf16_buf = [](int64_t n) { return Buffer(size_t(n) * 2); };
  auto norm = [&](const float* in, const std::string& name, Buffer& out, Buffer& out_b, float* mu, float* rs) {
    if (m.bf16_gemms) {
      out_b = bf16_buf(M * D);
      layernorm_forward_to(in, m.f(name + ".weight"), m.f(name + ".bias"), eps, M, D, out_b.get(), bf, mu, rs);
    } else {
      out = buf(M * D);
      layernorm_forward_to(in, m.f(name + ".weight"), m.f(name + ".bias"), eps, M, D, out.get(), s, mu, rs);
    }
  };
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    Saved& a = sv[size_t(l)];
    a.mu1 = buf(M), a.rs1 = buf(M), a.lse = buf(B * H * T), a.mu2 = buf(M), a.rs2 = buf(M);
    float* x_next = l + 1 < L ? sv[size_t(l + 1)].x.as<float>() : x_final.as<float>();
    norm(a.x.as<float>(), p + "ln_1", a.h1, a.h1b, a.mu1.as<float>(), a.rs1.as<float>());
    if (m.bf16_gemms) {  // the tensor-core kernels: bf16 operands, fp32 softmax and accumulation
      // qkv (bias by the epilogue) written as bf16; the attention reads q, k and v in place.
      a.qkvb = bf16_buf(M * 3 * D), a.yb = bf16_buf(M * D);
      mm({a.h1.as<float>(), a.h1b.get()}, Op::N, W(p + "attn.c_attn.weight"), Op::N, M, 3 * D, D, nullptr, 0.0f,
         m.f(p + "attn.c_attn.bias"), nullptr, a.qkvb.get());
      attention_forward_qkv(a.qkvb.get(), a.yb.get(), a.lse.as<float>(), as);
    } else {
      mm({a.h1.as<float>()}, Op::N, W(p + "attn.c_attn.weight"), Op::N, M, 3 * D, D, qkv.as<float>(), 0.0f);
      a.q = buf(M * D), a.k = buf(M * D), a.v = buf(M * D), a.y = buf(M * D);
      split_qkv_to(qkv.as<float>(), m.f(p + "attn.c_attn.bias"), a.q.get(), a.k.get(), a.v.get(), M, D, s);
      attention_forward(a.q.get(), a.k.get(), a.v.get(), a.y.get(), a.lse.as<float>(), as, s);
    }
    // xm = x + y W + b: the residual add by the GEMM's beta (x its addend), the bias by its epilogue.
    mm({a.y.as<float>(), a.yb.get()}, Op::N, W(p + "attn.c_proj.weight"), Op::N, M, D, D, a.xm.as<float>(), 1.0f,
       m.f(p + "attn.c_proj.bias"), a.x.as<float>());
    norm(a.xm.as<float>(), p + "ln_2", a.h2, a.h2b, a.mu2.as<float>(), a.rs2.as<float>());
    if (m.bf16_gemms) {  // bias and GELU by the GEMM's epilogue: ff2 and the pre-activation as bf16
      a.ffb = bf16_buf(M * F), a.ff2b = bf16_buf(M * F);
      GemmOut o{a.ff2b.get(), bf, nullptr, m.f(p + "mlp.c_fc.bias")};
      o.epi = Epilogue::Gelu, o.aux = a.ffb.get();
      gemm_out(Op::N, Op::N, M, F, D, 1.0f, a.h2b.get(), 0, W(p + "mlp.c_fc.weight").b, 0, 0.0f, o, 0, bf);
    } else {
      a.ff = buf(M * F), a.ff2 = buf(M * F);
      mm({a.h2.as<float>()}, Op::N, W(p + "mlp.c_fc.weight"), Op::N, M, F, D, a.ff.as<float>(), 0.0f);
      bias_gelu_tanh_to(a.ff.as<float>(), m.f(p + "mlp.c_fc.bias"), a.ff2.get(), M, F, s);
    }
    mm({a.ff2.as<float>(), a.ff2b.get()}, Op::N, W(p + "mlp.c_proj.weight"), Op::N, M, D, F, x_next, 1.0f,
       m.f(p + "mlp.c_proj.bias"), a.xm.as<float>());
  }
  const Buffer& x = x_final;
  // The LM head over wte's zero-padded Vp rows (the constructor): logits [M, Vp], their pad
  // columns zero; the loss reads the first V and zeroes the pad columns of dlogits.
  const int64_t Vp = m.numel.at("wte.weight") / D;
  Buffer hf, hfb, muf = buf(M), rsf = buf(M), loss = buf(M);
  norm(x.as<float>(), "ln_f", hf, hfb, muf.as<float>(), rsf.as<float>());
  // Loss and dlogits scaled by 1 / scored positions, dlogits in place of the logits: fp32, or under
  // bf16 GEMMs bf16 logits (the GEMM rounds its fp32 sums once) and the bf16 operand dlogits' two
  // GEMMs read.
  Buffer logits = m.bf16_gemms ? bf16_buf(M * Vp) : buf(M * Vp);
  const float inv_count = 1.0f / float(std::max<int64_t>(count, 1));
  if (m.bf16_gemms) {
    mm({hf.as<float>(), hfb.get()}, Op::N, W("wte.weight"), Op::T, M, Vp, D, nullptr, 0.0f, nullptr, nullptr,
       logits.get());
    cross_entropy_bf16(logits.get(), tgt.as<int64_t>(), M, V, loss.as<float>(), logits.get(), inv_count, 0.0f, Vp);
  } else {
    mm({hf.as<float>()}, Op::N, W("wte.weight"), Op::T, M, Vp, D, logits.as<float>(), 0.0f);
    cross_entropy_to(logits.as<float>(), tgt.as<int64_t>(), M, V, loss.as<float>(), logits.get(), s, inv_count, 0.0f,
                     Vp);
  }
  Buffer dlb = m.bf16_gemms ? std::move(logits) : Buffer();
  std::vector<float> losses(static_cast<size_t>(M));
  device::download(losses.data(), loss.get(), losses.size() * 4);
  double total = 0.0;
  for (float l : losses) total += l;

  // Backward. dx carries the residual stream's adjoint.
  // fp32 dff2, dff, dy and dqkv only without bf16 GEMMs: with them, their producers (GEMMs and
  // their epilogues, the attention's backward) write the bf16 operands alone.
  // The norms' backwards write dx's bf16 copy (dxb) and add its column sums into the bias gradient
  // of the GEMM whose output gradient dx is next (no cast and no bias_grad pass over dx).
  // dh (the norms' output gradients) comes from its GEMMs as bf16 under bf16 GEMMs.
  Buffer dh = m.bf16_gemms ? bf16_buf(M * D) : buf(M * D), dx = buf(M * D);
  Buffer dxb = m.bf16_gemms ? bf16_buf(M * D) : Buffer();
  void* dh_b = m.bf16_gemms ? dh.get() : nullptr;
  const auto dh_st = m.bf16_gemms ? bf : s;
  auto proj2_bias = [&](int64_t l) { return l >= 0 ? m.gr("h." + std::to_string(l) + ".mlp.c_proj.bias") : nullptr; };
  Buffer dff2 = m.bf16_gemms ? Buffer() : buf(M * F), dy = m.bf16_gemms ? bf16_buf(M * D) : buf(M * D);
  Buffer dff = m.bf16_gemms ? Buffer() : buf(M * F), dqkv = m.bf16_gemms ? Buffer() : buf(M * 3 * D);
  Buffer dq = m.bf16_gemms ? Buffer() : buf(M * D), dk = m.bf16_gemms ? Buffer() : buf(M * D),
         dv = m.bf16_gemms ? Buffer() : buf(M * D);
  const float* dlogits = m.bf16_gemms ? nullptr : logits.as<float>();
  mm({dlogits, dlb.get()}, Op::N, W("wte.weight"), Op::N, M, D, Vp, dh.as<float>(), 0.0f, nullptr, nullptr,
     dh_b);  // dhf = dlogits wte
  mm({dlogits, dlb.get()}, Op::T, {hf.as<float>(), hfb.get()}, Op::N, Vp, D, M, m.gr("wte.weight"),
     1.0f);  // dwte += dlogitsᵀ hf
  dlb = Buffer();
  layernorm_backward_residual(x.as<float>(), m.f("ln_f.weight"), muf.as<float>(), rsf.as<float>(), dh.get(), dh_st, M,
                              D, dx.as<float>(), dxb.get(), m.gr("ln_f.weight"), m.gr("ln_f.bias"), proj2_bias(L - 1),
                              /*accumulate=*/false);
  for (int64_t l = L - 1; l >= 0; --l) {
    const std::string p = "h." + std::to_string(l) + ".";
    Saved& a = sv[size_t(l)];
    // MLP: x_out = xm + ff2 Wp2 + bp2 (bp2's gradient was added by the norm's backward that wrote dx).
    // Under bf16 GEMMs dff comes straight from the GEMM through the GELU's gradient (its epilogue,
    // reading the saved pre-activation), then c_fc's bias gradient is dff's column sums; else
    // dff2, then the GELU's backward with the bias gradient in one pass.
    Buffer db = m.bf16_gemms ? bf16_buf(M * F) : Buffer();
    if (m.bf16_gemms) {
      GemmOut o{db.get(), bf};
      o.epi = Epilogue::GeluGrad, o.aux = a.ffb.get();
      gemm_out(Op::N, Op::T, M, F, D, 1.0f, dxb.get(), 0, W(p + "mlp.c_proj.weight").b, 0, 0.0f, o, 0, bf);
    } else {
      mm({dx.as<float>()}, Op::N, W(p + "mlp.c_proj.weight"), Op::T, M, F, D, dff2.as<float>(), 0.0f);
    }
    mm({a.ff2.as<float>(), a.ff2b.get()}, Op::T, {dx.as<float>(), dxb.get()}, Op::N, F, D, M,
       m.gr(p + "mlp.c_proj.weight"), 1.0f);
    if (!m.bf16_gemms)
      gelu_tanh_backward_bias(a.ff.as<float>(), dff2.as<float>(), M, F, dff.as<float>(), nullptr,
                              m.gr(p + "mlp.c_fc.bias"));
    mm({dff.as<float>(), db.get()}, Op::N, W(p + "mlp.c_fc.weight"), Op::T, M, D, F, dh.as<float>(), 0.0f, nullptr,
       nullptr, dh_b);
    if (m.bf16_gemms) {
      column_sums(db.get(), M, F, F, bf, m.gr(p + "mlp.c_fc.bias"));
      mm({a.h2.as<float>(), a.h2b.get()}, Op::T, {nullptr, db.get()}, Op::N, D, F, M, m.gr(p + "mlp.c_fc.weight"),
         1.0f);
    } else {
      mm({a.h2.as<float>()}, Op::T, {dff.as<float>()}, Op::N, D, F, M, m.gr(p + "mlp.c_fc.weight"), 1.0f);
    }
    layernorm_backward_residual(a.xm.as<float>(), m.f(p + "ln_2.weight"), a.mu2.as<float>(), a.rs2.as<float>(),
                                dh.get(), dh_st, M, D, dx.as<float>(), dxb.get(), m.gr(p + "ln_2.weight"),
                                m.gr(p + "ln_2.bias"), m.gr(p + "attn.c_proj.bias"), /*accumulate=*/true);
    // Attention: xm = x + y Wp + bp (bp's gradient added by the norm's backward above).
    mm({dx.as<float>(), dxb.get()}, Op::N, W(p + "attn.c_proj.weight"), Op::T, M, D, D, dy.as<float>(), 0.0f, nullptr,
       nullptr, m.bf16_gemms ? dy.get() : nullptr);
    mm({a.y.as<float>(), a.yb.get()}, Op::T, {dx.as<float>(), dxb.get()}, Op::N, D, D, M,
       m.gr(p + "attn.c_proj.weight"), 1.0f);
    if (m.bf16_gemms) {
      // The gradient comes back packed as the bf16 dqkv the two GEMMs read, c_attn's bias
      // gradient added on the way (no merge).
      db = bf16_buf(M * 3 * D);
      attention_backward_qkv(a.qkvb.get(), a.yb.get(), a.lse.as<float>(), dy.get(), db.get(),
                             m.gr(p + "attn.c_attn.bias"), as);
    } else {
      // dq gathers atomic adds; dk and dv are written over (accumulate_kv false): no clearing pass.
      device::zero(dq.get(), dq.bytes());
      attention_backward(a.q.get(), a.k.get(), a.v.get(), a.y.get(), a.lse.as<float>(), dy.get(), dq.as<float>(),
                         dk.as<float>(), dv.as<float>(), as, s, /*accumulate_kv=*/false);
      // The merge and c_attn's bias gradient in one pass.
      merge_qkv_bias(dq.as<float>(), dk.as<float>(), dv.as<float>(), M, D, dqkv.as<float>(), nullptr,
                     m.gr(p + "attn.c_attn.bias"));
    }
    mm({dqkv.as<float>(), db.get()}, Op::N, W(p + "attn.c_attn.weight"), Op::T, M, D, 3 * D, dh.as<float>(), 0.0f,
       nullptr, nullptr, dh_b);
    mm({a.h1.as<float>(), a.h1b.get()}, Op::T, {dqkv.as<float>(), db.get()}, Op::N, D, 3 * D, M,
       m.gr(p + "attn.c_attn.weight"), 1.0f);
    // The first block's dx feeds only the embeddings' backward: no copy, no bias.
    layernorm_backward_residual(a.x.as<float>(), m.f(p + "ln_1.weight"), a.mu1.as<float>(), a.rs1.as<float>(),
                                dh.get(), dh_st, M, D, dx.as<float>(), l > 0 ? dxb.get() : nullptr,
                                m.gr(p + "ln_1.weight"), m.gr(p + "ln_1.bias"), proj2_bias(l - 1),
                                /*accumulate=*/true);
  }
  embedding_backward(ids.as<int64_t>(), M, D, dx.get(), m.gr("wte.weight"), s);
  embedding_backward(gpos.as<int64_t>(), M, D, dx.get(), m.gr("wpe.weight"), s);

  ++m.step;
  m.adam->step(AdamWStep{lr, adam.beta1, adam.beta2, adam.eps, 0.0f, m.step});
  device::synchronize();
  return float(total / double(std::max<int64_t>(count, 1)));
}

void Gpt2Runner::set_bf16_gemms(bool on) {
  impl_->bf16_gemms = on;
  impl_->wb_fresh = false;  // fp32 steps in between leave the copies behind
}

void Gpt2Runner::copy_to(const Gpt2Model& model) const {
  if (impl_->st != device::Storage::F32) throw error("gpt2 cuda", "copy_to needs fp32 weights");
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    K3_CHECK(p.value.dtype() == DType::F32 && p.value.is_contiguous());
    device::download(p.value.f32(), impl_->w.at(name).get(), p.value.nbytes());
  });
}

}  // namespace k3::cuda
