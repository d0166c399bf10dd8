// The continuous-batching scheduler of `k3 serve`. One thread owns the model: each iteration it
// admits queued requests (up to max_batch sequences, against the memory manager's budget),
// prefills each new one (resuming from the prefix cache's deepest snapshot and
// taking new snapshots at block boundaries), then runs one decode step for every active
// sequence together (Model::logits with B = active sequences, T = 1, one Context each). With
// max_step_tokens, prefills run in chunks after each decode step, within what the step leaves of
// the token budget, their states and caches carried from chunk to chunk.
// Finished, cancelled and timed-out sequences leave the batch at once. No HTTP here.
//
// Memory (memory_manager.h): admission reserves a sequence's fixed memories and the pages of
// its prompt; each decode step takes the pages its new token needs. When the budget has no page
// left for a running sequence, the most recently admitted sequence that still needs pages is
// preempted (vLLM's recompute preemption): its context is dropped and it goes back to the front
// of the queue. It is readmitted once the pages of its whole run (prompt + max_tokens) are free,
// and holds them all, so it is never preempted again. It then prefills its prompt as before and
// replays its generated tokens one decode step at a time, keeping its sampler, so its output is
// what it would have been (the same forwards in the same order; a single prefill of the history
// would be faster but not bit-identical to decode; on CUDA the first run's steps were graph
// replays, whose latent attention is split for the caches' capacity, so its logits may differ
// from the rerun's in the last bits). No request fails for want of pages: submit()
// refuses one whose prompt + max_tokens could not fit the budget alone.
//
// Each request has its own seeded Sampler and feeds the same logits to it as k3::generate, so a
// request's tokens equal `k3 generate` with the same seed (exactly for prompts shorter than one
// cache block, which are prefilled in one pass as generate does, up to batching: a decode row's
// logits move by ~1e-5 when other sequences share the step (measured on every fixture model on
// the CPU: 3e-6 to 1.4e-5 max abs, B = 2..16 against B = 1; the BLAS picks its kernels by row
// count), so a sampled token can differ now and then).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/device.h"
#include "infer/generate.h"
#include "infer/json_constraint.h"
#include "infer/sampler.h"
#include "infer/serve/memory_manager.h"
#include "infer/serve/prefix_cache.h"
#include "models/model.h"

namespace k3::serve {

enum class Finish : uint8_t { None, Length, Eos, Stop, Cancelled, Timeout, Error };
const char* finish_name(Finish f);

// Log-probabilities at one position under the model: the log-softmax of its raw logits (before
// the sampler's penalty, temperature and truncation, as vLLM reports by default).
struct TokenLogprob {
  int64_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int64_t, float>> top;  // the most likely tokens, most likely first
};
// The entry of `token` given logits [V], with the `top` most likely tokens (ties: lower id first).
TokenLogprob token_logprob(const float* logits, int64_t V, int64_t token, int64_t top);

struct GenParams {
  std::vector<int64_t> prompt;
  int64_t max_tokens = 16;
  SamplingOptions sampling;
  bool stop_at_eos = true;
  double timeout_s = 600;
  int64_t logprobs = -1;         // -1: none; else a TokenLogprob per new token with this many top
  bool prompt_logprobs = false;  // also one per prompt token after the first (echo); max_tokens may be 0
  // Output constrained to JSON (SchedulerOptions::token_bytes needed): each draw is masked, and
  // the request finishes (Stop) when the document is whole.
  std::shared_ptr<const JsonSchema> json;
};

class Scheduler;

// One request's progress, shared between the scheduler thread (producer) and the HTTP thread
// (consumer).
class Job {
 public:
  // Waits up to `wait` for new tokens; appends them to out (and their logprobs to *lp when the
  // request asked for them). True once the job has finished and every token has been handed out.
  bool poll(std::vector<int64_t>& out, std::chrono::milliseconds wait, std::vector<TokenLogprob>* lp = nullptr);
  // Prompt tokens 1..n-1 scored (GenParams::prompt_logprobs); complete once poll has returned a
  // token or the end.
  std::vector<TokenLogprob> prompt_logprobs() const;
  // Asks the scheduler to drop the request (client gone, stop string seen); `why` is recorded
  // as its finish reason unless it already finished.
  void cancel(Finish why = Finish::Cancelled);
  Finish finish() const;
  std::string error() const;
  int64_t prompt_tokens() const { return int64_t(params_.prompt.size()); }
  int64_t cached_tokens() const { return cached_tokens_.load(); }
  double ttft_seconds() const { return ttft_s_.load(); }  // submit -> first token

 private:
  friend class Scheduler;
  void emit(int64_t token, TokenLogprob lp);
  void done(Finish f, const std::string& err = {});

  GenParams params_;
  std::chrono::steady_clock::time_point submitted_, deadline_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> pending_;
  std::vector<TokenLogprob> pending_lp_, prompt_lp_;
  Finish finish_ = Finish::None;
  std::string error_;
  std::atomic<bool> cancel_{false};
  std::atomic<Finish> cancel_reason_{Finish::Cancelled};
  std::atomic<int64_t> cached_tokens_{0};
  std::atomic<double> ttft_s_{0};
  // Scheduler-thread state.
  Context ctx_;
  std::unique_ptr<Drafter> drafter_;  // SchedulerOptions::draft_model or speculate_mtp, made on the first check
  std::unique_ptr<JsonConstraint> json_;   // GenParams::json
  std::unique_ptr<Sampler> sampler_;
  std::vector<int64_t> history_;  // prompt + generated; empty until the first prefill
  int64_t generated_ = 0, next_ = -1;
  // Chunked prefill: prompt tokens in the context so far, and for a preempted job the next
  // generated token to replay; true until the prompt (and replay) is done.
  int64_t prefill_pos_ = 0;
  size_t replay_pos_ = 0;
  bool prefilling_ = false, resuming_ = false;
  MemoryManager::Account mem_;    // under the scheduler's lock
};

struct SchedulerOptions {
  int64_t max_batch = 8;
  int64_t context = 1024;               // tokens per sequence (prompt + new)
  size_t memory_budget = size_t(1) << 30;  // bytes of running sequences' memories (memory_manager.h)
  int64_t page_tokens = 16;             // tokens per page of a growing memory
  int64_t max_queue = 1024;
  int64_t cache_block = 64;             // snapshot every this many prompt tokens; 0: no prefix cache
  size_t cache_budget = size_t(256) << 20;
  size_t cache_host_budget = 0;         // the prefix cache's host tier (prefix_cache.h); 0: none
  // Tokens one iteration computes: the decode rows first, then chunks of the prompts being
  // prefilled fill the rest, so a long prompt no longer stalls the running streams. 0: each new
  // prompt is prefilled whole when admitted. Otherwise it must exceed max_batch.
  int64_t max_step_tokens = 0;
  // Prompt-lookup speculation for requests without logprobs, greedy or sampled (generate.h): a job whose
  // sequence offers an n-gram draft runs its own check of up to draft_tokens tokens instead of a
  // row of the batched decode step.
  bool speculate_ngram = false;
  // Or drafts from a smaller model of the same vocabulary (ModelDrafter): each speculating job
  // keeps a context of it (outside memory_budget), dropped when the job finishes or is preempted.
  const Model* draft_model = nullptr;
  // Or drafts from the model's multi-token-prediction layer (MtpDrafter): each job's context keeps
  // its hidden states (so do its prefix-cache snapshots) and a context of the MTP layer.
  bool speculate_mtp = false;
  int64_t draft_tokens = 4;
  // The tokenizer's token bytes, for requests constrained to JSON (GenParams::json).
  std::shared_ptr<const TokenBytes> token_bytes;
};

struct SchedulerMetrics {
  int64_t submitted = 0, rejected = 0;
  int64_t finished[7] = {};             // by Finish
  int64_t prompt_tokens = 0, prefill_tokens = 0, generated_tokens = 0;
  int64_t decode_steps = 0, decode_rows = 0;
  int64_t spec_checks = 0, spec_drafted = 0, spec_accepted = 0;  // speculation: checks, drafts proposed, kept
  int64_t replayed_steps = 0;  // decode steps run as one CUDA graph replay (Decoder)
  int64_t preemptions = 0, recomputed_tokens = 0;  // recomputed: tokens run again after a preemption
  int64_t queue_depth = 0, active = 0, prefilling = 0;  // active: decoding; prefilling: prompts in progress
  MemoryStats memory;                   // the manager's pages and reservations
  std::array<size_t, 4> active_bytes_by_kind{};  // bytes the running contexts allocate
  double tokens_per_second = 0;         // generated tokens over the last few seconds
  double ttft_sum_s = 0;
  int64_t ttft_count = 0;
  PrefixCacheStats cache;
};

class Scheduler {
 public:
  Scheduler(const Model& model, SchedulerOptions opts);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request (validated already: ids in the vocabulary, prompt + max_tokens <= context).
  // Throws k3::Error when it can never fit the memory budget or the queue is full.
  std::shared_ptr<Job> submit(GenParams p);
  void stop();  // finishes every request (Cancelled) and joins the thread
  SchedulerMetrics metrics() const;
  const SchedulerOptions& options() const { return o_; }
  size_t estimate_bytes(int64_t tokens) const { return mm_.bytes_for(tokens); }  // a sequence of `tokens`

 private:
  void loop();
  // Sets a newly admitted (or readmitted) job up for its prefill: sampler, context (from the
  // prefix cache's deepest snapshot), position.
  void start_prefill(Job& j);
  // Runs up to `budget` tokens of the job's prefill (prompt chunks, stopping at cache block
  // boundaries to snapshot; then a preempted job's replay); on the prompt's end samples the first
  // token. Returns the tokens computed; clears prefilling_ when done.
  int64_t advance_prefill(Job& j, int64_t budget);
  void make_room(std::vector<std::shared_ptr<Job>>& active);  // pages for this step, preempting
  void decode(std::vector<std::shared_ptr<Job>>& active);
  // One speculative check of a job (SchedulerOptions::speculate_ngram or draft_model); false when it has
  // no draft (its pages were taken by make_room), and decodes with the batch instead. Returns the tokens computed
  // through *tokens.
  bool speculate(Job& j, int64_t* tokens);
  bool speculating() const { return o_.speculate_ngram || o_.draft_model || o_.speculate_mtp; }
  int64_t draft_room(const Job& j) const;  // tokens a speculating job may draft this step (0: none)
  bool check_stop(Job& j);  // cancelled / timed out -> finished
  void sample(Job& j, float* logits);  // draws, emits and records the next token
  // The draw alone (the job's sampler and its logprobs), no shared state touched: a decode
  // step's sequences draw in parallel, then accept in order.
  std::pair<int64_t, TokenLogprob> draw(Job& j, float* logits) const;
  void accept(Job& j, int64_t next, const TokenLogprob& lp);  // emits and records a drawn token
  void retire(Job& j, Finish f, const std::string& err = {});
  void count_tokens(int64_t n);

  const Model& model_;
  SchedulerOptions o_;
  PrefixCache cache_;
  int64_t V_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  MemoryManager mm_;
  SchedulerMetrics m_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> recent_;  // (time, tokens)
  std::vector<std::shared_ptr<Job>> active_;  // loop thread only, in admission order; sizes mirrored into m_
  std::vector<std::shared_ptr<Job>> prefilling_;  // admitted, prompt not finished (loop thread only)
  // Batches replay their decode step as a CUDA graph while the batch stays the same jobs (Decoder,
  // picks for greedy batches, logits for the rest; loop thread only). The jobs are held so that no
  // new job takes an old one's address while the decoder lives.
  std::unique_ptr<Decoder> decoder_;
  std::vector<float> step_logits_;  // a sampled decode step's [B, V] logits, reused (loop thread only)
  device::HostPin step_pin_;        // step_logits_ page-locked when the model is on the device
  std::vector<std::shared_ptr<Job>> decoder_jobs_;
  std::thread thread_;
};

}  // namespace k3::serve
