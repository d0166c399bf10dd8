// Synthetic recall tasks (Zoology's MQAR; Kimi Linear's Palindrome and Stack; associative recall
// with key overwrites and under capacity pressure, where forgetting pays): deterministic
// generators of token sequences with per-position targets (-1 where nothing is asked). The
// layouts, vocabularies and defaults are documented in recall_tasks.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3 {

enum class RecallTask : uint8_t { Mqar, Palindrome, Stack, Overwrite, Capacity, Niah };

RecallTask parse_recall_task(const std::string& name);  // k3::Error on an unknown name
std::string recall_task_name(RecallTask t);

struct RecallTaskOptions {
  RecallTask task = RecallTask::Mqar;
  int64_t seq_len = 128;
  // MQAR: key-value pairs; Palindrome: tokens to reverse; Stack: number of stacks; Overwrite:
  // distinct keys, rebound again and again; Capacity: how many of the latest writes a query may
  // ask about; Niah: needles hidden in the filler (one is asked). 0 = the task's default for
  // seq_len (default_pairs).
  int64_t pairs = 0;
  int64_t vocab = 0;          // 0 = the task's default (default_vocab)
  double power_a = 0.01;      // MQAR: query placement p(gap g) ∝ (g+1)^(a-1) (Zoology)
};

// Task tokens. MQAR: 0 = filler (non-query positions, Zoology's random_non_queries = False),
// keys [1, V/2), values [V/2, V); Overwrite and Capacity use the same key and value ranges. Niah:
// 0 = pad, 1 = <needle>, 2 = <query>, filler [3, V/2), keys [V/2, 3V/4), values [3V/4, V). Palindrome: 0 = pad, 1 = <sep>, content [2, V). Stack: 0 = pad,
// 1 = <push>, 2 = <pop>, stack ids [3, 3+S), values [3+S, V).
namespace recall_tokens {
constexpr int64_t kFiller = 0, kPad = 0, kSep = 1, kPush = 1, kPop = 2, kStackIdBase = 3;
constexpr int64_t kNeedle = 1, kQuery = 2, kNiahFillerBase = 3;
}

int64_t default_pairs(RecallTask t, int64_t seq_len);
int64_t default_vocab(RecallTask t);

// Fills in the defaults (pairs, vocab) and validates; k3::Error if the layout does not fit.
RecallTaskOptions resolved(RecallTaskOptions o);

// A batch of B examples: ids [B, T] and targets [B, T] (targets[i] = the token expected as
// the prediction at position i, -1 where no answer is scored).
struct RecallBatch {
  int64_t B = 0, T = 0;
  std::vector<int64_t> ids, targets;
  int64_t answers() const;  // number of targets >= 0
};

// Example `index` of the stream `seed` (a pure function of (options, seed, index)).
void make_recall_example(const RecallTaskOptions& o, uint64_t seed, uint64_t index, int64_t* ids, int64_t* targets);
// Examples first .. first+B-1 of the stream `seed`.
RecallBatch make_recall_batch(const RecallTaskOptions& o, uint64_t seed, uint64_t first, int64_t B);

// The stream seeds of the training and the held-out test examples (different streams).
uint64_t recall_train_seed(uint64_t seed);
uint64_t recall_test_seed(uint64_t seed);

}  // namespace k3
