#include "infer/serve/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <tuple>

#include "core/error.h"
#include "core/parallel.h"
#include "infer/generate.h"

namespace k3::serve {

using clock = std::chrono::steady_clock;

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::None: return "none";
    case Finish::Length: return "length";
    case Finish::Eos: return "eos";
    case Finish::Stop: return "stop";
    case Finish::Cancelled: return "cancelled";
    case Finish::Timeout: return "timeout";
    case Finish::Error: return "error";
  }
  return "?";
}

TokenLogprob token_logprob(const float* logits, int64_t V, int64_t token, int64_t top) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[v]));
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(logits[v]) - mx);
  const double lse = mx + std::log(sum);
  TokenLogprob lp;
  lp.token = token;
  lp.logprob = float(double(logits[token]) - lse);
  std::vector<int64_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), int64_t(0));
  const auto k = ids.begin() + std::min(std::max<int64_t>(top, 0), V);
  std::partial_sort(ids.begin(), k, ids.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (auto it = ids.begin(); it != k; ++it) lp.top.emplace_back(*it, float(double(logits[*it]) - lse));
  return lp;
}

// ---- Job ----

bool Job::poll(std::vector<int64_t>& out, std::chrono::milliseconds wait, std::vector<TokenLogprob>* lp) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [&] { return !pending_.empty() || finish_ != Finish::None; });
  out.insert(out.end(), pending_.begin(), pending_.end());
  pending_.clear();
  if (lp) std::move(pending_lp_.begin(), pending_lp_.end(), std::back_inserter(*lp));
  pending_lp_.clear();
  return finish_ != Finish::None;
}

std::vector<TokenLogprob> Job::prompt_logprobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prompt_lp_;
}

void Job::cancel(Finish why) {
  cancel_reason_ = why;
  cancel_ = true;
}

Finish Job::finish() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finish_;
}

std::string Job::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Job::emit(int64_t token, TokenLogprob lp) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(token);
    if (params_.logprobs >= 0) pending_lp_.push_back(std::move(lp));
  }
  cv_.notify_all();
}

void Job::done(Finish f, const std::string& err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finish_ != Finish::None) return;
    finish_ = f;
    error_ = err;
  }
  cv_.notify_all();
}

// ---- Scheduler ----

Scheduler::Scheduler(const Model& model, SchedulerOptions opts)
    : model_(model),
      o_(opts),
      cache_(opts.cache_block, opts.cache_budget, opts.cache_host_budget),
      V_(model.vocab_size()),
      mm_(model.memory_layers(), opts.memory_budget, opts.page_tokens) {
  if (o_.max_batch < 1) throw error("serve", "max_batch must be >= 1");
  if (o_.context < 2) throw error("serve", "the context must be >= 2 tokens");
  if (o_.max_step_tokens > 0 && o_.max_step_tokens <= o_.max_batch)
    throw error("serve", "max_step_tokens (", o_.max_step_tokens, ") must exceed max_batch (", o_.max_batch,
                "): the decode rows come first and the prompts need room after them");
  if (int(o_.speculate_ngram) + int(o_.draft_model != nullptr) + int(o_.speculate_mtp) > 1)
    throw error("serve", "speculation drafts by one of prompt lookup, a draft model or the model's MTP layer");
  if (o_.speculate_mtp && !model.mtp())
    throw error("serve", "speculation by multi-token prediction needs a checkpoint with an MTP layer; this model has none");
  if (o_.draft_model) {
    if (o_.draft_model->vocab_size() != V_)
      throw error("serve", "the draft model's vocabulary (", o_.draft_model->vocab_size(), ") differs from the model's (",
                  V_, "): it must share the tokenizer");
    if (o_.draft_model->max_positions() < o_.context)
      throw error("serve", "the context (", o_.context, " tokens) exceeds the draft model's ",
                  o_.draft_model->max_positions(), " positions");
  }
  if (speculating() && o_.draft_tokens < 1)
    throw error("serve", "speculation needs at least one draft token");
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { stop(); }

std::shared_ptr<Job> Scheduler::submit(GenParams p) {
  auto j = std::make_shared<Job>();
  const size_t need = estimate_bytes(int64_t(p.prompt.size()) + p.max_tokens);
  j->submitted_ = clock::now();
  // At most a year: a longer limit would overflow the clock's range and expire at once.
  const double limit_s = std::clamp(p.timeout_s, 0.0, 365.0 * 86400.0);
  j->deadline_ = j->submitted_ + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(limit_s));
  j->params_ = std::move(p);
  if (j->params_.json) {
    if (!o_.token_bytes) throw error("serve", "output constrained to JSON needs the tokenizer's token bytes");
    j->json_ = std::make_unique<JsonConstraint>(j->params_.json, o_.token_bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) throw error("serve", "the server is shutting down");
  if (need > o_.memory_budget) {
    m_.rejected++;
    throw error("serve", "the request needs ", need, " bytes of context memory, more than the budget of ",
                o_.memory_budget);
  }
  if (int64_t(queue_.size()) >= o_.max_queue) {
    m_.rejected++;
    throw error("serve", "the queue is full (", o_.max_queue, " requests waiting)");
  }
  m_.submitted++;
  m_.prompt_tokens += int64_t(j->params_.prompt.size());
  queue_.push_back(j);
  cv_.notify_all();
  return j;
}

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::retire(Job& j, Finish f, const std::string& err) {
  j.ctx_ = Context();  // free the memory now, not when the HTTP thread lets go
  j.drafter_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    mm_.release(j.mem_);
    m_.finished[size_t(f)]++;
  }
  j.done(f, err);  // last: whoever wakes on it sees the memory released and the job counted
}

bool Scheduler::check_stop(Job& j) {
  if (j.cancel_) {
    retire(j, j.cancel_reason_.load());
    return true;
  }
  if (clock::now() > j.deadline_) {
    retire(j, Finish::Timeout);
    return true;
  }
  return false;
}

void Scheduler::count_tokens(int64_t n) {
  auto now = clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  m_.generated_tokens += n;
  recent_.emplace_back(now, n);
  while (!recent_.empty() && now - recent_.front().first > std::chrono::seconds(10)) recent_.pop_front();
}

void Scheduler::start_prefill(Job& j) {
  const std::vector<int64_t>& p = j.params_.prompt;
  const int64_t n = int64_t(p.size());
  j.resuming_ = !j.history_.empty();  // preempted: rebuild its context
  const bool score = j.params_.prompt_logprobs;  // every prompt position's logits are needed
  if (!j.resuming_) {
    j.sampler_ = std::make_unique<Sampler>(j.params_.sampling);
    j.history_ = p;
    if (j.params_.max_tokens == 0 && !score) {
      retire(j, Finish::Length);
      return;
    }
  }
  // Resume from the deepest cached snapshot that leaves at least one token to run (a scored
  // prompt runs whole: a snapshot has no logits).
  int64_t pos = cache_.enabled() && !score ? cache_.lookup(p, n - 1, &j.ctx_) : 0;
  if (pos == 0) j.ctx_ = model_.new_context(o_.context);
  // The MTP drafter reads the context's hidden states from the first token on (a snapshot keeps
  // those of its prefix).
  if (o_.speculate_mtp && !j.ctx_.hidden) {
    if (pos > 0) j.ctx_ = model_.new_context(o_.context), pos = 0;
    j.ctx_.hidden = std::make_shared<Context::HiddenRows>();
  }
  if (!j.resuming_) j.cached_tokens_ = pos;
  j.prefill_pos_ = pos;
  j.replay_pos_ = size_t(n);
  j.prefilling_ = true;
}

int64_t Scheduler::advance_prefill(Job& j, int64_t budget) {
  const std::vector<int64_t>& p = j.params_.prompt;
  const int64_t n = int64_t(p.size());
  const bool resume = j.resuming_, score = j.params_.prompt_logprobs;
  int64_t used = 0;
  auto computed = [&](int64_t tokens) {
    used += tokens;
    std::lock_guard<std::mutex> lock(mu_);
    (resume ? m_.recomputed_tokens : m_.prefill_tokens) += tokens;
  };
  // A scored prompt runs in chunks of at most kScoreChunk tokens, bounding its [T, V] logits.
  constexpr int64_t kScoreChunk = 64;
  std::vector<float> logits(static_cast<size_t>(V_ * (score ? kScoreChunk : 1)));
  float* last = logits.data();  // the logits after the prompt's last token
  const int64_t blk = cache_.enabled() ? cache_.block() : 0;
  int64_t& pos = j.prefill_pos_;
  while (pos < n && used < budget) {
    // Stop at the next block boundary (to snapshot there), at the end of the budget, or at the
    // end of the prompt.
    const int64_t room = budget - used;
    int64_t end = room >= n - pos ? n : pos + room;
    if (blk > 0 && (pos / blk + 1) * blk <= end) end = (pos / blk + 1) * blk;
    if (score) end = std::min(end, pos + kScoreChunk);
    const int64_t T = end - pos;
    model_.forward(p.data() + pos, T, &j.ctx_, logits.data(), score ? Logits::All : Logits::Last);
    if (score && !resume) {
      std::vector<TokenLogprob> lps;  // row t predicts token pos + t + 1
      for (int64_t t = 0; t < T && pos + t + 1 < n; ++t)
        lps.push_back(token_logprob(logits.data() + t * V_, V_, p[size_t(pos + t + 1)], j.params_.logprobs));
      std::lock_guard<std::mutex> lock(j.mu_);
      std::move(lps.begin(), lps.end(), std::back_inserter(j.prompt_lp_));
    }
    if (score) last = logits.data() + (T - 1) * V_;
    computed(T);
    pos = end;
    if (blk > 0 && pos % blk == 0) cache_.insert(p, pos, j.ctx_);
    if (pos < n && check_stop(j)) return used;
  }
  if (pos < n) return used;  // the budget ran out: more next iteration
  if (resume) {
    // Replay the generated tokens as the decode steps that first absorbed them (one token each),
    // all but the last, which the next decode step feeds. The sampler already drew them all.
    for (size_t& t = j.replay_pos_; t + 1 < j.history_.size() && used < budget; ++t) {
      if (check_stop(j)) return used;
      model_.forward(&j.history_[t], 1, &j.ctx_, logits.data(), Logits::Last);
      computed(1);
    }
    if (j.replay_pos_ + 1 < j.history_.size()) return used;
    j.prefilling_ = false;
    return used;
  }
  j.prefilling_ = false;
  if (o_.speculate_mtp && draft_room(j) == 0) j.ctx_.hidden.reset();  // a job that never drafts
  if (j.params_.max_tokens == 0) {  // only the prompt was to be scored
    retire(j, Finish::Length);
    return used;
  }
  j.ttft_s_ = std::chrono::duration<double>(clock::now() - j.submitted_).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    m_.ttft_sum_s += j.ttft_s_.load();
    m_.ttft_count++;
  }
  count_tokens(1);
  sample(j, last);
  return used;
}

std::pair<int64_t, TokenLogprob> Scheduler::draw(Job& j, float* logits) const {
  std::vector<float> raw;
  if (j.params_.logprobs >= 0) raw.assign(logits, logits + V_);  // the sampler edits logits in place
  if (j.json_ && j.json_->mask(logits, V_) == 0) return {-1, TokenLogprob{}};  // nothing continues the JSON
  const int64_t next = j.sampler_->sample(logits, V_, j.history_);
  return {next, raw.empty() ? TokenLogprob{} : token_logprob(raw.data(), V_, next, j.params_.logprobs)};
}

void Scheduler::sample(Job& j, float* logits) {
  const auto [next, lp] = draw(j, logits);
  accept(j, next, lp);
}

void Scheduler::accept(Job& j, int64_t next, const TokenLogprob& lp) {
  if (next < 0) {
    retire(j, Finish::Error, "no token of the vocabulary continues the JSON output");
    return;
  }
  if (j.json_) j.json_->accept(next);
  j.history_.push_back(next);
  j.generated_++;
  j.next_ = next;
  j.emit(next, lp);
  if (j.params_.stop_at_eos && model_.eos_token_id && next == *model_.eos_token_id) retire(j, Finish::Eos);
  else if (j.json_ && j.json_->done()) retire(j, Finish::Stop);
  else if (j.generated_ >= j.params_.max_tokens) retire(j, Finish::Length);
}

void Scheduler::make_room(std::vector<std::shared_ptr<Job>>& active) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < active.size();) {
    Job& j = *active[i];
    // This step feeds history_.back(): the context then holds the whole history, and the drafts
    // a speculating job checks. Their pages are taken here, with preemption if need be, so that
    // a job checks drafts at every step whatever the load: its sampled tokens then take the same
    // draws as in an unloaded run.
    if (mm_.grow(j.mem_, int64_t(j.history_.size()) + draft_room(j))) {
      ++i;
      continue;
    }
    // Out of pages: the most recently admitted sequence that still needs pages (active is in
    // admission order; j is one) goes back to the front of the queue, older ones keep their
    // progress. One that holds the pages of its whole run never needs more: it is spared.
    auto v = active.end() - 1;
    while (mm_.pages_for((*v)->prompt_tokens() + (*v)->params_.max_tokens) <= (*v)->mem_.pages) --v;
    std::shared_ptr<Job> victim = *v;
    active.erase(v);
    mm_.release(victim->mem_);
    victim->ctx_ = Context();
    victim->drafter_.reset();
    m_.preemptions++;
    queue_.push_front(std::move(victim));
  }
}

int64_t Scheduler::draft_room(const Job& j) const {
  if (!speculating() || j.params_.logprobs >= 0 || j.json_) return 0;
  const int64_t left = j.params_.max_tokens - j.generated_;  // tokens still to make
  return std::clamp<int64_t>(left - 1, 0, o_.draft_tokens);  // the last needs no forward after it
}

bool Scheduler::speculate(Job& j, int64_t* tokens) {
  const int64_t k = draft_room(j);  // make_room took the pages for k drafts
  if (k < 1) return false;
  std::vector<int64_t> drafts;
  if (o_.draft_model || o_.speculate_mtp) {
    if (!j.drafter_ && o_.draft_model) j.drafter_ = std::make_unique<ModelDrafter>(*o_.draft_model, o_.context);
    if (!j.drafter_ && o_.speculate_mtp) j.drafter_ = std::make_unique<MtpDrafter>(model_, j.ctx_, o_.context);
    drafts = j.drafter_->draft(j.history_, k);
  } else {
    drafts = ngram_draft(j.history_, SpeculateOptions{}.ngram_max, k);
  }
  if (drafts.empty()) return false;
  const int64_t d = int64_t(drafts.size());
  const DraftCheck c = check_drafts(model_, j.ctx_, j.next_, drafts, j.sampler_.get(), j.history_);
  if (j.drafter_) j.drafter_->kept(c.kept);
  *tokens = c.tokens;
  const int64_t m = c.kept;
  {
    std::lock_guard<std::mutex> lock(mu_);
    m_.spec_checks++;
    m_.spec_drafted += d;
    m_.spec_accepted += m;
  }
  int64_t made = 0;
  for (int64_t i = 0; i <= m && j.finish() == Finish::None; ++i, ++made)
    accept(j, i < m ? drafts[size_t(i)] : c.bonus, TokenLogprob{});
  count_tokens(made);
  return true;
}

void Scheduler::decode(std::vector<std::shared_ptr<Job>>& active) {
  const int64_t B = int64_t(active.size());
  std::vector<int64_t> ids(static_cast<size_t>(B));
  std::vector<Context*> ctxs(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    ids[size_t(b)] = active[size_t(b)]->next_;
    ctxs[size_t(b)] = &active[size_t(b)]->ctx_;
  }
  // A batch of greedy requests without logprobs takes the model's picks: on the device the step
  // brings back B ids instead of B·V logits. Other batches take the logits for their samplers.
  // While the batch stays the same jobs (whose requests fix the output too) the step is one CUDA
  // graph replay (Decoder; a new batch starts a new decoder).
  const bool greedy = std::all_of(active.begin(), active.end(), [](const std::shared_ptr<Job>& j) {
    return j->sampler_->greedy() && j->params_.logprobs < 0 && !j->json_;
  });
  const Decoder::Output output = greedy ? Decoder::Output::Picks : Decoder::Output::Logits;
  if (active != decoder_jobs_) {
    decoder_.reset();
    decoder_jobs_.clear();
  }
  if (!decoder_) {
    decoder_ = std::make_unique<Decoder>(model_, ctxs, true, output);
    decoder_jobs_ = active;
  }
  // The logits' buffer is kept from step to step (64 sequences of a 160K vocabulary are 42 MB,
  // which a fresh vector would zero every step); the decoder writes every element.
  if (!greedy && step_logits_.size() < size_t(B * V_)) {
    step_pin_ = {};  // unlocked before the vector moves
    step_logits_.resize(size_t(B * V_));
    // Downloaded into every step: locked, they come back at the link's rate (13 MB at 64 GPT-2
    // sequences took ~2 ms a step through pageable staging).
    if (model_.head_weight()->value.device() == Device::CUDA)
      step_pin_ = device::HostPin(step_logits_.data(), step_logits_.size() * sizeof(float));
  }
  float* logits = step_logits_.data();
  std::vector<int64_t> picks(static_cast<size_t>(B));
  if (greedy)
    decoder_->step(ids.data(), picks.data());
  else
    decoder_->step(ids.data(), logits);
  {
    std::lock_guard<std::mutex> lock(mu_);
    m_.decode_steps++;
    m_.decode_rows += B;
    if (decoder_->replaying()) m_.replayed_steps++;
  }
  count_tokens(B);
  // Sampled rows draw on the thread pool (each job its own sampler: the same tokens as drawn in
  // order), then every sequence takes its token in order.
  std::vector<TokenLogprob> lps(static_cast<size_t>(greedy ? 0 : B));
  if (!greedy)
    parallel_for(B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        std::tie(picks[size_t(b)], lps[size_t(b)]) = draw(*active[size_t(b)], logits + b * V_);
    });
  for (int64_t b = 0; b < B; ++b) accept(*active[size_t(b)], picks[size_t(b)], greedy ? TokenLogprob{} : lps[size_t(b)]);
}

void Scheduler::loop() {
  auto& active = active_;
  for (;;) {
    std::vector<std::shared_ptr<Job>> admitted;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !active.empty() || !prefilling_.empty(); });
      if (stop_) break;
      // Drop queued requests that were cancelled or ran out of time while waiting.
      for (auto it = queue_.begin(); it != queue_.end();) {
        Job& j = **it;
        Finish f = j.cancel_ ? j.cancel_reason_.load() : clock::now() > j.deadline_ ? Finish::Timeout : Finish::None;
        if (f == Finish::None) {
          ++it;
          continue;
        }
        m_.finished[size_t(f)]++;
        j.done(f);
        it = queue_.erase(it);
      }
      // Admission: batch slots and the memory budget (a lone request is always admitted: it
      // fitted the budget at submit).
      while (!queue_.empty() && int64_t(active.size() + prefilling_.size() + admitted.size()) < o_.max_batch) {
        auto& j = queue_.front();
        // A new sequence takes the pages of its prompt. A preempted one comes back only with the
        // pages of its whole run, so it is never preempted twice (no thrashing: each replay of a
        // history is paid at most once per request).
        const int64_t tokens = j->history_.empty() ? j->prompt_tokens() : j->prompt_tokens() + j->params_.max_tokens;
        if (!mm_.admit(j->mem_, tokens)) break;
        admitted.push_back(j);
        queue_.pop_front();
      }
    }
    // A prefill that fails fails its request only; the server and the other requests carry on.
    auto guarded = [&](Job& j, auto&& f) {
      try {
        f();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "k3 serve: request failed in prefill: %s\n", e.what());
        retire(j, Finish::Error, e.what());
      }
    };
    for (auto& j : admitted) {
      guarded(*j, [&] { start_prefill(*j); });
      if (j->finish() == Finish::None) prefilling_.push_back(j);
    }
    // The prompts being prefilled: whole at once without a step budget (before this step's decode,
    // which they join), else in chunks after it. Done ones join the decoding batch.
    auto prefill_within = [&](int64_t budget) {
      for (auto& j : prefilling_)
        if (j->finish() == Finish::None) check_stop(*j);
      for (auto& j : prefilling_) {
        if (budget <= 0) break;
        if (j->finish() != Finish::None) continue;
        guarded(*j, [&] { budget -= advance_prefill(*j, budget); });
      }
      for (auto& j : prefilling_)
        if (!j->prefilling_ && j->finish() == Finish::None) active.push_back(j);
      std::erase_if(prefilling_, [](const std::shared_ptr<Job>& j) { return !j->prefilling_ || j->finish() != Finish::None; });
    };
    if (o_.max_step_tokens <= 0) prefill_within(INT64_MAX);
    // Leave out what finished, was cancelled or timed out.
    std::erase_if(active, [&](const std::shared_ptr<Job>& j) { return j->finish() != Finish::None || check_stop(*j); });
    make_room(active);
    // Greedy jobs with a draft check it on their own; the others decode together.
    int64_t decoded = 0;
    std::vector<std::shared_ptr<Job>> batch;
    for (auto& j : active) {
      int64_t tokens = 0;
      bool own = false;
      if (speculating()) {
        try {
          own = speculate(*j, &tokens);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "k3 serve: speculative step failed: %s\n", e.what());
          retire(*j, Finish::Error, e.what());
          own = true;
        }
      }
      if (own) decoded += tokens;
      else batch.push_back(j);
    }
    decoded += int64_t(batch.size());
    if (!batch.empty()) {
      try {
        decode(batch);
      } catch (const std::exception& e) {
        // A failed batched step leaves the batch's contexts in an unknown state: those requests
        // fail, the server and later requests carry on.
        std::fprintf(stderr, "k3 serve: decode step failed: %s\n", e.what());
        for (auto& j : batch)
          if (j->finish() == Finish::None) retire(*j, Finish::Error, e.what());
      }
    }
    std::erase_if(active, [](const std::shared_ptr<Job>& j) { return j->finish() != Finish::None; });
    if (o_.max_step_tokens > 0) prefill_within(std::max<int64_t>(1, o_.max_step_tokens - decoded));
    if (active.empty()) decoder_.reset(), decoder_jobs_.clear();  // idle: let the finished jobs go
    std::lock_guard<std::mutex> lock(mu_);
    m_.active = int64_t(active.size());
    m_.prefilling = int64_t(prefilling_.size());
    m_.active_bytes_by_kind = {};
    for (auto& j : active)
      for (const auto& mem : j->ctx_.layers) m_.active_bytes_by_kind[size_t(mem->kind())] += mem->bytes();
  }
  // Shutting down: everything still queued or running is cancelled.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& j : queue_) j->done(Finish::Cancelled);
  for (auto& j : active) j->done(Finish::Cancelled);
  for (auto& j : prefilling_) j->done(Finish::Cancelled);
  queue_.clear();
  active.clear();
  prefilling_.clear();
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerMetrics m = m_;
  m.queue_depth = int64_t(queue_.size());
  m.memory = mm_.stats();
  if (!recent_.empty()) {
    double span = std::max(1.0, std::chrono::duration<double>(clock::now() - recent_.front().first).count());
    int64_t n = 0;
    for (auto& [t, k] : recent_) n += k;
    m.tokens_per_second = double(n) / span;
  }
  m.cache = cache_.stats();
  return m;
}

}  // namespace k3::serve
