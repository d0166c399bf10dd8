// The prefill/decode loop for one sequence: the prompt goes through in one forward pass that
// fills the context's memories, then one token per step.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "infer/json_constraint.h"
#include "infer/sampler.h"
#include "models/model.h"

namespace k3 {

enum class StopAtEos : uint8_t { Yes, No };

// Speculative decoding by prompt lookup: the last `ngram` tokens (down to 1) are looked up earlier
// in the sequence and the `draft_tokens` that followed them there are proposed; one forward of the
// model over the next token and the drafts checks them all, the drafts it keeps are kept with one
// more token from that forward, and the context is rolled back to the last kept token (snapshot
// before the check, the kept tokens run again). Greedy decoding keeps the drafts equal to its
// picks: in exact arithmetic the output is the non-speculative greedy output. Sampling keeps each
// draft with the target's probability of it and otherwise draws from the rest of the target's
// distribution (Sampler::verify), so the tokens follow the target's distribution exactly (the
// draws differ from a non-speculative run of the same seed).
// With a draft model instead (a smaller model of the same vocabulary, drafting greedily on its own
// context, rolled back with the target's), or the model's multi-token-prediction head (mtp), the
// same checks apply to their drafts.
struct SpeculateOptions {
  bool ngram = false, mtp = false;
  const Model* draft_model = nullptr;
  int64_t draft_tokens = 4, ngram_max = 3;
};

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  SamplingOptions sampling;
  StopAtEos stop_at_eos = StopAtEos::Yes;
  SpeculateOptions speculate;
  // Output constrained to JSON (json_constraint.h): each draw is masked with the vocabulary's
  // token bytes, and generation stops when the document is whole. Not with speculation.
  std::shared_ptr<const JsonSchema> json;
  std::shared_ptr<const TokenBytes> token_bytes;
};

struct GenerateStats {
  int64_t prompt_tokens = 0, new_tokens = 0;
  int64_t drafted = 0, accepted = 0, verify_steps = 0;  // speculation: drafts proposed, kept; checks run
  // Rollback: time copying the states a rejection restores (before each check), time re-running
  // the kept tokens after rejections, and the tokens re-run. Keeping every position's states
  // instead would copy them at each of the checked positions (check_tokens of them) and re-run
  // nothing: about mark_seconds * check_tokens / verify_steps.
  double mark_seconds = 0, rerun_seconds = 0;
  int64_t rerun_tokens = 0, check_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  size_t context_bytes = 0;  // the sequence's memory at the end
};

// Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens
// (n = ngram_max down to 1); empty when none recurs.
std::vector<int64_t> ngram_draft(const std::vector<int64_t>& ids, int64_t ngram_max, int64_t k);

// One speculative check: `next` and the drafts go through the model in one forward over ctx
// (which has absorbed everything before `next`); without a sampler (or a greedy one) the drafts
// equal to the model's greedy picks are kept and `bonus` is the pick after the last kept one; with
// a sampler each draft is verified (Sampler::verify; history: the tokens up to and including
// `next`) and `bonus` is the replacement draw at the first rejection, or a draw after the last. On
// a rejection a context of KV and latent caches alone is truncated after the kept drafts; one with
// recurrent states or conv tails (which cannot be) is restored from a snapshot taken before the
// check and `next` and the kept drafts run again. Either way ctx ends having absorbed exactly
// `next` and the kept drafts.
struct DraftCheck {
  int64_t kept = 0, bonus = -1;
  int64_t tokens = 0;  // tokens the model computed (the check, and the rerun after a rejection)
  double mark_seconds = 0, rerun_seconds = 0;  // copying the states before, re-running after
};
DraftCheck check_drafts(const Model& model, Context& ctx, int64_t next, const std::vector<int64_t>& drafts,
                        Sampler* sampler = nullptr, const std::vector<int64_t>& history = {});

// A point a context can go back to: memories that keep every token (KV, latent caches) are
// truncated to their lengths at the mark; states that fold tokens in (recurrent states, conv
// tails) are copied at the mark and restored.
class ContextMark {
 public:
  explicit ContextMark(const Context& ctx);
  void rewind(Context& ctx) const;
  // Whether every memory keeps each token (nothing folds tokens in): then the context can go back
  // to `keep` tokens past the mark by truncation alone (keep_past), with nothing to re-run.
  bool truncates_all() const;
  void keep_past(Context& ctx, int64_t keep) const;

 private:
  std::vector<int64_t> lengths_;
  std::vector<std::unique_ptr<Memory>> saved_;
  int64_t position_ = 0;
};

// Where drafts come from, for a drafter that keeps state of its own (a draft model's context, an
// MTP head's).
class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to k drafts to follow `history` (the sequence, ending with the token the target checks next).
  virtual std::vector<int64_t> draft(const std::vector<int64_t>& history, int64_t k) = 0;
  // The target kept the first `kept` of the last draft()'s tokens.
  virtual void kept(int64_t kept) {}
  virtual size_t bytes() const = 0;  // the drafter's own context memory
};

// Greedy drafts from a smaller model of the same vocabulary (SpeculateOptions::draft_model). Its
// context trails the target's sequence: each draft() first feeds, in one forward, the tokens of
// the history it has not absorbed (the whole prompt the first time, then what the target emitted
// since), so it follows a sequence whose steps ran with or without checks.
class ModelDrafter final : public Drafter {
 public:
  ModelDrafter(const Model& draft, int64_t context);
  std::vector<int64_t> draft(const std::vector<int64_t>& history, int64_t k) override;
  void kept(int64_t kept) override;
  size_t bytes() const override;

 private:
  const Model& m_;
  Context ctx_;
  int64_t absorbed_ = 0;  // tokens of the history in ctx_
  int64_t drafted_ = 0;   // the last draft()'s tokens
  std::optional<ContextMark> mark_;  // ctx_ before the last drafts were fed
};

// Greedy drafts from the model's own multi-token-prediction head (Model::mtp(), SpeculateOptions::
// mtp). The target context keeps its hidden states while the drafter lives (Context::hidden); each
// draft() first feeds the head, in one forward, the rows of the history it has not absorbed (row i:
// the target's hidden state at i and token i+1), whose last row gives the first draft; further
// drafts feed the head its own output and are taken back afterwards.
// The target context must keep its hidden states from its first token on (Context::hidden: set
// before the prompt's forward, or restored with a prefix-cache snapshot that kept them; the
// constructor checks it is set); draft()
// gives none when the rows it needs were not kept (a forward that bypassed Model::logits / greedy).
class MtpDrafter final : public Drafter {
 public:
  MtpDrafter(const Model& model, Context& target, int64_t context);
  std::vector<int64_t> draft(const std::vector<int64_t>& history, int64_t k) override;
  size_t bytes() const override;

 private:
  const Model& m_;
  Context& target_;
  Context ctx_;
  int64_t absorbed_ = 0;  // rows in ctx_
};

// Returns prompt + generated ids. on_token(id) is called for each new token as it is made.
std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token = {}, GenerateStats* stats = nullptr);

}  // namespace k3
