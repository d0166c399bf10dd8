#include "models/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/random.h"
#include "ffn/mlp.h"
#include "mixers/attention/softmax_attention.h"
#include "ops/ag.h"

namespace k3 {

void Gpt2Config::validate(const std::string& where) const {
  if (n_embd % n_head != 0)
    throw error("config", where, ": n_embd = ", n_embd, " is not divisible by n_head = ", n_head);
  if (!tie_word_embeddings)
    throw error("config", where, ": tie_word_embeddings = false is not supported for gpt2 (HF GPT-2 ties lm_head to wte)");
  if (!scale_attn_weights || scale_attn_by_inverse_layer_idx)
    throw error("config", where, ": only the standard attention scale 1/sqrt(head_dim) is supported");
}

Gpt2Model::Gpt2Model(const Gpt2Config& c) : c_(c) {
  const int64_t D = c.n_embd;
  wte_ = parameter({c.vocab_size, D});
  wpe_ = parameter({c.n_positions, D});
  const float eps = float(c.layer_norm_epsilon);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    auto attn = std::make_unique<SoftmaxAttention>(
        SoftmaxAttentionOptions{D, c.n_head, c.n_positions, WeightLayout::InOut, c.k3_short_conv.value_or(0)});
    auto mlp = std::make_unique<GeluMlp>(D, c.n_inner.value_or(4 * D), WeightLayout::InOut);
    blocks_.add(PreNormBlock(Norm(NormType::LayerNorm, D, eps), std::move(attn), Norm(NormType::LayerNorm, D, eps),
                             std::move(mlp), BlockNames{"ln_1", "attn", "ln_2", "mlp"}));
  }
  ln_f_ = Norm(NormType::LayerNorm, D, eps);
  eos_token_id = c.eos_token_id;
}

std::unique_ptr<Model> Gpt2Model::from_config(const Json& j, const std::string& where) {
  auto c = read_config<Gpt2Config>(j, where);
  c.validate(where);
  return std::make_unique<Gpt2Model>(c);
}

std::unique_ptr<Model> Gpt2Model::load(const std::string& dir, const Json& j, const LoadPlan& plan) {
  auto m = from_config(j, dir + "/config.json");
  Checkpoint ckpt = Checkpoint::open(dir);
  LoadOptions opts;
  opts.plan = plan;
  opts.alias = [](const std::string& n) { return std::vector<std::string>{n, "transformer." + n}; };
  opts.ignorable = [](const std::string& n) {
    auto ends = [&](const char* s) { return n.size() >= std::strlen(s) && n.compare(n.size() - std::strlen(s), std::string::npos, s) == 0; };
    return ends(".attn.bias") || ends(".attn.masked_bias") || n == "lm_head.weight";
  };
  load_params(*m, ckpt, opts);
  return m;
}

void Gpt2Model::visit(const ParamVisitor& v) const {
  v("wte.weight", *wte_, ParamKind::Embedding);
  v("wpe.weight", *wpe_, ParamKind::Embedding);
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l].visit("h." + std::to_string(l), v);
  ln_f_.visit("ln_f", v);
}

Json Gpt2Model::config_json() const {
  Json j = write_config(c_);
  j["architectures"] = {"GPT2LMHeadModel"};
  if (!c_.k3_short_conv) j.erase("k3_short_conv");  // plain GPT-2 keeps HF's key set
  return j;
}

std::vector<LayerMemory> Gpt2Model::memory_layers() const { return blocks_.memory_layers(); }

Context Gpt2Model::new_context(int64_t max_tokens) const { return blocks_.new_context(max_tokens); }

Var Gpt2Model::hidden(const TokenBatch& batch) const {
  const int64_t B = batch.B, T = batch.T;
  std::vector<int64_t> ids(batch.ids, batch.ids + B * T), pos(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = batch.contexts ? batch.contexts[b]->position : 0;
    if (p0 + T > c_.n_positions)
      throw error("gpt2", "position ", p0 + T, " exceeds n_positions = ", c_.n_positions);
    for (int64_t t = 0; t < T; ++t) pos[size_t(b * T + t)] = p0 + t;
  }
  Var x = ag::add(ag::embedding(wte_, ids), ag::position_embedding(wpe_, pos));  // [B*T, D]
  x = blocks_.forward(x, B, T, batch.contexts);
  return ln_f_(x);
}

void Gpt2Model::init_random(uint64_t seed) {
  // GPT-2 / llm.c init (spec §1): N(0, 0.02); residual projections 0.02/sqrt(2L); biases 0;
  // LayerNorm weights 1.
  materialize_params(*this);
  Rng rng(seed);
  const float proj_std = 0.02f / std::sqrt(2.0f * float(c_.n_layer));
  visit([&](const std::string& name, Node& param, ParamKind k) {
    float* p = param.value.f32();
    const int64_t n = param.value.numel();
    if (k == ParamKind::Bias || (k == ParamKind::Norm && name.ends_with(".bias"))) {
      for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
    } else if (k == ParamKind::Norm) {
      for (int64_t i = 0; i < n; ++i) p[i] = 1.0f;
    } else {
      float std = name.ends_with("c_proj.weight") ? proj_std : 0.02f;
      for (int64_t i = 0; i < n; ++i) p[i] = std * rng.normal();
    }
  });
}

}  // namespace k3
