#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "core/error.h"
#include "models/mtp.h"

namespace k3 {

std::vector<int64_t> ngram_draft(const std::vector<int64_t>& ids, int64_t ngram_max, int64_t k) {
  const int64_t n_ids = int64_t(ids.size());
  for (int64_t n = std::min(ngram_max, n_ids - 1); n >= 1; --n) {
    const int64_t* tail = ids.data() + n_ids - n;
    for (int64_t p = n_ids - n - 1; p >= 0; --p)  // latest earlier occurrence first
      if (std::equal(tail, tail + n, ids.data() + p)) {
        const int64_t from = p + n, to = std::min(n_ids, from + k);
        if (to > from) return std::vector<int64_t>(ids.begin() + from, ids.begin() + to);
      }
  }
  return {};
}

DraftCheck check_drafts(const Model& model, Context& ctx, int64_t next, const std::vector<int64_t>& drafts,
                        Sampler* sampler, const std::vector<int64_t>& history) {
  const int64_t V = model.vocab_size(), d = int64_t(drafts.size()), T = d + 1;
  std::vector<int64_t> in{next};
  in.insert(in.end(), drafts.begin(), drafts.end());
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  const ContextMark mark(ctx);  // what a rejection goes back to
  const double mark_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  std::vector<float> logits(static_cast<size_t>(T * V));
  model.forward(in.data(), T, &ctx, logits.data(), Logits::All);
  // Row t's pick follows in[0..t]; drafts[t] is kept while it equals the pick before it.
  auto pick = [&](int64_t t) {
    const auto row = logits.begin() + t * V;
    return int64_t(std::max_element(row, row + V) - row);
  };
  DraftCheck c;
  if (!sampler || sampler->greedy()) {
    while (c.kept < d && drafts[size_t(c.kept)] == pick(c.kept)) ++c.kept;
    c.bonus = pick(c.kept);
  } else {  // speculative sampling: each draft kept with its probability, else a draw from the rest
    std::vector<int64_t> hist = history;
    for (; c.kept < d; ++c.kept) {
      const int64_t tok = sampler->verify(logits.data() + c.kept * V, V, hist, drafts[size_t(c.kept)]);
      if (tok != drafts[size_t(c.kept)]) {
        c.bonus = tok;
        break;
      }
      hist.push_back(tok);
    }
    if (c.kept == d) c.bonus = sampler->sample(logits.data() + d * V, V, hist);
  }
  c.tokens = T;
  c.mark_seconds = mark_seconds;
  if (c.kept < d && mark.truncates_all()) {
    mark.keep_past(ctx, c.kept + 1);
  } else if (c.kept < d) {
    t0 = clock::now();
    mark.rewind(ctx);
    model.forward(in.data(), c.kept + 1, &ctx, logits.data(), Logits::Last);
    c.tokens += c.kept + 1;
    c.rerun_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  }
  return c;
}

ContextMark::ContextMark(const Context& ctx) : position_(ctx.position) {
  for (const auto& m : ctx.layers) {
    lengths_.push_back(m->length());
    saved_.push_back(m->can_truncate() ? nullptr : m->clone());
  }
}

bool ContextMark::truncates_all() const {
  return std::all_of(saved_.begin(), saved_.end(), [](const auto& m) { return m == nullptr; });
}

void ContextMark::keep_past(Context& ctx, int64_t keep) const {
  K3_CHECK(truncates_all(), "keep_past: the context has memories that cannot be truncated");
  for (size_t i = 0; i < ctx.layers.size(); ++i) ctx.layers[i]->truncate(lengths_[i] + keep);
  ctx.position = position_ + keep;
}

void ContextMark::rewind(Context& ctx) const {
  for (size_t i = 0; i < ctx.layers.size(); ++i) {
    if (saved_[i])
      ctx.layers[i]->restore(*saved_[i]);
    else
      ctx.layers[i]->truncate(lengths_[i]);
  }
  ctx.position = position_;
}

ModelDrafter::ModelDrafter(const Model& draft, int64_t context) : m_(draft), ctx_(draft.new_context(context)) {}

std::vector<int64_t> ModelDrafter::draft(const std::vector<int64_t>& history, int64_t k) {
  drafted_ = 0;
  mark_.reset();
  const int64_t n = int64_t(history.size());
  if (k < 1 || n <= absorbed_) return {};
  Context* ctxs[1] = {&ctx_};
  int64_t pick = 0;
  m_.greedy(TokenBatch{history.data() + absorbed_, 1, n - absorbed_, ctxs}, &pick);
  absorbed_ = n;
  std::vector<int64_t> d = {pick};
  if (k > 1) mark_.emplace(ctx_);  // everything confirmed, nothing drafted
  while (int64_t(d.size()) < k) {
    const int64_t in = d.back();
    m_.greedy(TokenBatch{&in, 1, 1, ctxs}, &pick);
    d.push_back(pick);
  }
  drafted_ = k;
  return d;
}

void ModelDrafter::kept(int64_t kept) {
  // The last draft was never fed: the context holds the history and drafts 1..k-1, which is right
  // when the target kept at least those; otherwise it goes back to the mark and the kept drafts
  // are fed with the next ones.
  if (kept >= drafted_ - 1)
    absorbed_ += std::max<int64_t>(drafted_ - 1, 0);
  else if (mark_)
    mark_->rewind(ctx_);
  mark_.reset();
  drafted_ = 0;
}

size_t ModelDrafter::bytes() const { return ctx_.bytes(); }

MtpDrafter::MtpDrafter(const Model& model, Context& target, int64_t context) : m_(model), target_(target) {
  if (!model.mtp())
    throw error("speculate", "the model has no multi-token-prediction layer (its checkpoint holds none)");
  K3_CHECK(target_.hidden, "MtpDrafter: the target context does not keep its hidden states (Context::hidden)");
  ctx_ = model.mtp()->new_context(context);
}

std::vector<int64_t> MtpDrafter::draft(const std::vector<int64_t>& history, int64_t k) {
  const int64_t n = int64_t(history.size());
  // Rows absorbed_ .. n-2: the target's hidden state at i with token i+1 (the last: with the token
  // the target checks next).
  Context::HiddenRows& h = *target_.hidden;
  if (k < 1 || n < 2 || absorbed_ > n - 2 || h.start > absorbed_ || h.start + h.count() < n - 1) return {};
  const MtpHead& head = *m_.mtp();
  const Device dev = m_.head_weight()->value.device();
  const int64_t T = n - 1 - absorbed_, D = h.dim;
  Tensor prev = Tensor::empty({T, D});
  std::copy_n(h.rows.begin() + (absorbed_ - h.start) * D, T * D, prev.f32());
  std::vector<int64_t> next(history.begin() + absorbed_ + 1, history.end());
  Var o = head.forward(constant(dev == Device::CPU ? prev : prev.to_device(dev)), next, &ctx_);
  absorbed_ = n - 1;
  // The target's rows before the token it checks next are no longer needed.
  h.rows.erase(h.rows.begin(), h.rows.begin() + (n - 1 - h.start) * D);
  h.start = n - 1;
  std::vector<int64_t> d = {head.pick(o)};
  if (k == 1) return d;
  const ContextMark mark(ctx_);
  while (int64_t(d.size()) < k) {
    const int64_t m = o->value.dim(0);
    if (m > 1) o = constant(o->value.slice(0, m - 1, m).clone());
    o = head.forward(o, {d.back()}, &ctx_);
    d.push_back(head.pick(o));
  }
  mark.rewind(ctx_);
  return d;
}

size_t MtpDrafter::bytes() const { return ctx_.bytes(); }

namespace {

// Decoding with speculation (SpeculateOptions: prompt lookup or a draft model), greedy or
// sampled. `first` is the token the prefill chose.
void speculate(Model& model, Context& ctx, std::vector<int64_t>& ids, int64_t first, Sampler& sampler,
               const GenerateOptions& opts, const std::function<void(int64_t)>& on_token, GenerateStats* stats) {
  const SpeculateOptions& so = opts.speculate;
  std::unique_ptr<Drafter> drafter;
  const int64_t room = int64_t(ids.size()) + opts.max_new_tokens;
  if (so.draft_model) drafter = std::make_unique<ModelDrafter>(*so.draft_model, room);
  if (so.mtp) drafter = std::make_unique<MtpDrafter>(model, ctx, room);
  Context* ctxs[1] = {&ctx};
  int64_t made = 0;
  auto emit = [&](int64_t t) {  // false once generation ends
    ids.push_back(t);
    ++made;
    if (on_token) on_token(t);
    if (opts.stop_at_eos == StopAtEos::Yes && model.eos_token_id && t == *model.eos_token_id) return false;
    return made < opts.max_new_tokens;
  };
  const int64_t V = model.vocab_size();
  std::vector<float> logits(static_cast<size_t>(V));
  int64_t next = first;
  while (emit(next)) {
    // Drafts, never past the tokens still to make (the last of them needs no forward after it).
    const int64_t k = std::min(so.draft_tokens, opts.max_new_tokens - made - 1);
    std::vector<int64_t> drafts = drafter ? drafter->draft(ids, k) : ngram_draft(ids, so.ngram_max, k);
    if (drafts.empty()) {
      const int64_t in = next;
      if (sampler.greedy()) {
        model.greedy(TokenBatch{&in, 1, 1, ctxs}, &next);
      } else {
        model.forward(&in, 1, &ctx, logits.data(), Logits::Last);
        next = sampler.sample(logits.data(), V, ids);
      }
      continue;
    }
    const DraftCheck c = check_drafts(model, ctx, next, drafts, &sampler, ids);
    if (drafter) drafter->kept(c.kept);
    if (stats) {
      stats->drafted += int64_t(drafts.size()), stats->accepted += c.kept, stats->verify_steps++;
      stats->mark_seconds += c.mark_seconds, stats->rerun_seconds += c.rerun_seconds;
      stats->check_tokens += int64_t(drafts.size()) + 1;
      stats->rerun_tokens += c.tokens - int64_t(drafts.size()) - 1;
    }
    const int64_t m = c.kept;
    bool go = true;
    for (int64_t i = 0; i < m && go; ++i) go = emit(drafts[size_t(i)]);
    if (!go) return;
    next = c.bonus;
  }
}

}  // namespace

std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token, GenerateStats* stats) {
  using clock = std::chrono::steady_clock;
  if (prompt.empty()) throw error("generate", "the prompt is empty (give at least one token)");
  if (opts.max_new_tokens < 0) throw error("generate", "max_new_tokens must be >= 0");
  const int64_t V = model.vocab_size();
  for (int64_t id : prompt)
    if (id < 0 || id >= V) throw error("generate", "prompt token id ", id, " is outside the vocabulary [0, ", V, ")");
  const int64_t total = int64_t(prompt.size()) + opts.max_new_tokens;
  if (total > model.max_positions())
    throw error("generate", "prompt (", prompt.size(), ") + max_new_tokens (", opts.max_new_tokens, ") = ", total,
                " exceeds the model's ", model.max_positions(), " positions");
  Sampler sampler(opts.sampling);
  std::optional<JsonConstraint> json;
  if (opts.json) {
    if (!opts.token_bytes) throw error("generate", "output constrained to JSON needs the tokenizer's token bytes");
    if (opts.speculate.ngram || opts.speculate.draft_model || opts.speculate.mtp)
      throw error("generate", "output constrained to JSON does not speculate");
    json.emplace(opts.json, opts.token_bytes);
  }
  Context ctx = model.new_context(total);
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<int64_t> ids = prompt;
  auto t0 = clock::now();
  // Greedy decoding takes the model's own pick (on the device only the id comes back); a sampler
  // takes the last position's logits. From the third token on each step is one CUDA graph replay
  // where the model's step allows it.
  const bool greedy = sampler.greedy() && !json;  // a constrained draw needs the logits
  Context* ctxs[1] = {&ctx};
  Decoder decoder(model, {&ctx}, true, greedy ? Decoder::Output::Picks : Decoder::Output::Logits);
  int64_t picked = 0;
  const SpeculateOptions& so = opts.speculate;
  const bool speculating = so.ngram || so.draft_model || so.mtp;
  auto step_on = [&](const int64_t* in, int64_t T) {
    if (greedy && T == 1 && !speculating)
      decoder.step(in, &picked);
    else if (T == 1 && !speculating)
      decoder.step(in, logits.data());
    else if (greedy)
      model.greedy(TokenBatch{in, 1, T, ctxs}, &picked);
    else
      model.forward(in, T, &ctx, logits.data(), Logits::Last);
  };
  if (int(so.ngram) + int(so.draft_model != nullptr) + int(so.mtp) > 1)
    throw error("generate", "speculation drafts by one of prompt lookup, a draft model or the model's MTP layer");
  if (so.mtp && !model.mtp())
    throw error("generate", "speculation by multi-token prediction needs a checkpoint with an MTP layer; this model has none");
  if (so.mtp) ctx.hidden = std::make_shared<Context::HiddenRows>();  // the drafter reads the prompt's
  if (speculating && (so.draft_tokens < 1 || so.ngram_max < 1))
    throw error("generate", "speculation needs at least one draft token and an n-gram of at least 1");
  if (so.draft_model && so.draft_model->vocab_size() != V)
    throw error("generate", "the draft model's vocabulary (", so.draft_model->vocab_size(), ") differs from the model's (",
                V, "): it must share the tokenizer");
  if (so.draft_model && so.draft_model->max_positions() < total)
    throw error("generate", "prompt + max_new_tokens = ", total, " exceeds the draft model's ",
                so.draft_model->max_positions(), " positions");
  step_on(prompt.data(), int64_t(prompt.size()));
  auto t1 = clock::now();
  if (speculating && opts.max_new_tokens > 0)
    speculate(model, ctx, ids, greedy ? picked : sampler.sample(logits.data(), V, ids), sampler, opts, on_token, stats);
  for (int64_t step = 0; step < opts.max_new_tokens && !speculating; ++step) {
    if (json && json->mask(logits.data(), V) == 0) throw error("generate", "no token of the vocabulary continues the JSON");
    const int64_t next = greedy ? picked : sampler.sample(logits.data(), V, ids);
    if (json) json->accept(next);
    ids.push_back(next);
    if (on_token) on_token(next);
    if (opts.stop_at_eos == StopAtEos::Yes && model.eos_token_id && next == *model.eos_token_id) break;
    if (json && json->done()) break;
    if (step + 1 < opts.max_new_tokens) step_on(&next, 1);
  }
  auto t2 = clock::now();
  if (stats) {
    stats->prompt_tokens = int64_t(prompt.size());
    stats->new_tokens = int64_t(ids.size() - prompt.size());
    stats->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    stats->decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    stats->context_bytes = ctx.bytes();
  }
  return ids;
}

}  // namespace k3
