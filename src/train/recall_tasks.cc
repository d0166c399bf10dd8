#include "train/recall_tasks.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/random.h"

namespace k3 {

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  Rng r(a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull);
  r.next_u64();
  return r.next_u64() ^ b;
}

// k distinct values from [lo, hi) in random order (partial Fisher-Yates).
std::vector<int64_t> distinct(Rng& rng, int64_t lo, int64_t hi, int64_t k) {
  std::vector<int64_t> pool(static_cast<size_t>(hi - lo));
  std::iota(pool.begin(), pool.end(), lo);
  for (int64_t i = 0; i < k; ++i) {
    const size_t j = size_t(i) + size_t(rng.below(uint64_t(hi - lo - i)));
    std::swap(pool[size_t(i)], pool[j]);
  }
  pool.resize(static_cast<size_t>(k));
  return pool;
}

void mqar(const RecallTaskOptions& o, Rng& rng, int64_t* ids, int64_t* tgt) {
  const int64_t T = o.seq_len, P = o.pairs, V = o.vocab, half = V / 2;
  const std::vector<int64_t> keys = distinct(rng, 1, half, P);
  const std::vector<int64_t> values = distinct(rng, half, V, P);
  for (int64_t i = 0; i < P; ++i) {
    ids[2 * i] = keys[size_t(i)];
    ids[2 * i + 1] = values[size_t(i)];
  }
  // Query slots (a key and its value) in the rest of the sequence; key i goes to a distinct
  // slot drawn with p(slot s) ∝ (s+1)^(a-1), sequentially without replacement (numpy's
  // choice(replace=False, p=...) as Zoology uses it).
  const int64_t slots = (T - 2 * P) / 2;
  std::vector<double> w(static_cast<size_t>(slots));
  for (int64_t s = 0; s < slots; ++s) w[size_t(s)] = std::pow(double(s + 1), o.power_a - 1.0);
  for (int64_t i = 0; i < P; ++i) {
    double total = 0;
    for (double x : w) total += x;
    double u = rng.uniform_double() * total;
    int64_t pick = -1;
    for (int64_t s = 0; s < slots; ++s) {
      if (w[size_t(s)] <= 0) continue;
      pick = s;  // the last slot still available catches rounding at the top end
      if (u < w[size_t(s)]) break;
      u -= w[size_t(s)];
    }
    w[size_t(pick)] = 0;
    const int64_t pos = 2 * P + 2 * pick;
    ids[pos] = keys[size_t(i)];
    ids[pos + 1] = values[size_t(i)];
    tgt[pos] = values[size_t(i)];
  }
}

void palindrome(const RecallTaskOptions& o, Rng& rng, int64_t* ids, int64_t* tgt) {
  const int64_t n = o.pairs, lo = recall_tokens::kSep + 1;
  for (int64_t i = 0; i < n; ++i) ids[i] = lo + int64_t(rng.below(uint64_t(o.vocab - lo)));
  ids[n] = recall_tokens::kSep;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t x = ids[n - 1 - j];
    tgt[n + j] = x;        // predicted at <sep> and at each reversed token
    ids[n + 1 + j] = x;    // teacher forcing
  }
}

void stack(const RecallTaskOptions& o, Rng& rng, int64_t* ids, int64_t* tgt) {
  using namespace recall_tokens;
  const int64_t S = o.pairs, vlo = kStackIdBase + S, ops = o.seq_len / 3;
  std::vector<std::vector<int64_t>> stacks(static_cast<size_t>(S));
  std::vector<int64_t> nonempty;
  for (int64_t k = 0; k < ops; ++k) {
    int64_t* p = ids + 3 * k;
    nonempty.clear();
    for (int64_t s = 0; s < S; ++s)
      if (!stacks[size_t(s)].empty()) nonempty.push_back(s);
    if (!nonempty.empty() && rng.uniform() < 0.5f) {
      const int64_t s = nonempty[size_t(rng.below(nonempty.size()))];
      const int64_t x = stacks[size_t(s)].back();
      stacks[size_t(s)].pop_back();
      p[0] = kPop;
      p[1] = kStackIdBase + s;
      p[2] = x;
      tgt[3 * k + 1] = x;  // at the id of a pop: the element it pops
    } else {
      const int64_t s = int64_t(rng.below(uint64_t(S)));
      const int64_t x = vlo + int64_t(rng.below(uint64_t(o.vocab - vlo)));
      stacks[size_t(s)].push_back(x);
      p[0] = kPush;
      p[1] = kStackIdBase + s;
      p[2] = x;
    }
  }
}

// A stream of 2-token units `k v` over keys [1, V/2) and values [V/2, V). Once a key is bound, each
// unit is a query with probability 1/2: the key of an earlier write and, fed back after it is
// predicted, its latest value (the scored position is the key). Otherwise it is a write of a fresh
// random value. Overwrite: writes draw from `pairs` keys, so a key is rebound many times and only
// its latest value counts (stale bindings must be cleared). Capacity: every write takes a key not
// used before in the example (while any are left), so far more pairs are written than a small
// state holds, and a query asks one of the `pairs` most recently written keys.
void key_stream(const RecallTaskOptions& o, Rng& rng, int64_t* ids, int64_t* tgt) {
  const int64_t units = o.seq_len / 2, half = o.vocab / 2, n_keys = half - 1;
  const bool overwrite = o.task == RecallTask::Overwrite;
  std::vector<int64_t> latest(static_cast<size_t>(half), -1);  // key -> its latest value
  std::vector<int64_t> recent;                                // keys, most recently written last
  std::vector<int64_t> fresh = distinct(rng, 1, half, overwrite ? o.pairs : n_keys);
  size_t next_fresh = 0;
  for (int64_t u = 0; u < units; ++u) {
    int64_t* p = ids + 2 * u;
    if (!recent.empty() && rng.uniform() < 0.5f) {
      const int64_t window = overwrite ? int64_t(recent.size()) : std::min<int64_t>(o.pairs, int64_t(recent.size()));
      const int64_t k = recent[recent.size() - 1 - size_t(rng.below(uint64_t(window)))];
      p[0] = k;
      p[1] = latest[size_t(k)];
      tgt[2 * u] = latest[size_t(k)];
      continue;
    }
    int64_t k;
    if (overwrite) k = fresh[size_t(rng.below(fresh.size()))];
    else k = next_fresh < fresh.size() ? fresh[next_fresh++] : 1 + int64_t(rng.below(uint64_t(n_keys)));
    const int64_t v = half + int64_t(rng.below(uint64_t(o.vocab - half)));
    latest[size_t(k)] = v;
    const auto it = std::find(recent.begin(), recent.end(), k);
    if (it != recent.end()) recent.erase(it);
    recent.push_back(k);
    p[0] = k;
    p[1] = v;
  }
}

// Needles in a haystack (S-NIAH's synthetic form): random filler tokens over the whole sequence,
// `pairs` needles `<needle> k v` at distinct random places in it, and at the end `<query> k` for
// one of them, scored at k (predict its v). The state must keep a few bindings across a long run
// of tokens that matter for nothing.
void niah(const RecallTaskOptions& o, Rng& rng, int64_t* ids, int64_t* tgt) {
  using namespace recall_tokens;
  const int64_t T = o.seq_len, V = o.vocab, P = o.pairs, half = V / 2, kq = V / 2 + V / 4;
  const int64_t body = T - 2;  // the last two positions hold the query
  for (int64_t i = 0; i < body; ++i) ids[i] = kNiahFillerBase + int64_t(rng.below(uint64_t(half - kNiahFillerBase)));
  const std::vector<int64_t> keys = distinct(rng, half, kq, P);
  // Needle i at slot[i]: distinct, non-overlapping 3-token places in the body.
  const std::vector<int64_t> slots = distinct(rng, 0, body / 3, P);
  for (int64_t i = 0; i < P; ++i) {
    int64_t* p = ids + 3 * slots[size_t(i)];
    p[0] = kNeedle;
    p[1] = keys[size_t(i)];
    p[2] = kq + int64_t(rng.below(uint64_t(V - kq)));
  }
  const int64_t asked = int64_t(rng.below(uint64_t(P)));
  ids[T - 2] = kQuery;
  ids[T - 1] = keys[size_t(asked)];
  tgt[T - 1] = ids[3 * slots[size_t(asked)] + 2];
}

}  // namespace

RecallTask parse_recall_task(const std::string& name) {
  if (name == "mqar") return RecallTask::Mqar;
  if (name == "palindrome") return RecallTask::Palindrome;
  if (name == "stack") return RecallTask::Stack;
  if (name == "overwrite") return RecallTask::Overwrite;
  if (name == "capacity") return RecallTask::Capacity;
  if (name == "niah") return RecallTask::Niah;
  throw error("recall", "unknown task '", name, "' (mqar, palindrome, stack, overwrite, capacity, niah)");
}

std::string recall_task_name(RecallTask t) {
  switch (t) {
    case RecallTask::Mqar: return "mqar";
    case RecallTask::Palindrome: return "palindrome";
    case RecallTask::Stack: return "stack";
    case RecallTask::Overwrite: return "overwrite";
    case RecallTask::Capacity: return "capacity";
    case RecallTask::Niah: return "niah";
  }
  return "?";
}

int64_t default_pairs(RecallTask t, int64_t seq_len) {
  switch (t) {
    case RecallTask::Mqar: return std::max<int64_t>(1, seq_len / 8);
    case RecallTask::Palindrome: return std::max<int64_t>(1, (seq_len - 1) / 2);
    case RecallTask::Stack: return 64;
    case RecallTask::Overwrite: return 8;
    case RecallTask::Capacity: return std::max<int64_t>(1, seq_len / 8);
    case RecallTask::Niah: return 1;
  }
  return 1;
}

int64_t default_vocab(RecallTask) { return 256; }

RecallTaskOptions resolved(RecallTaskOptions o) {
  if (o.seq_len < 4) throw error("recall", "--seq-len must be at least 4");
  if (o.pairs <= 0) o.pairs = default_pairs(o.task, o.seq_len);
  if (o.vocab <= 0) o.vocab = default_vocab(o.task);
  const int64_t T = o.seq_len, P = o.pairs, V = o.vocab;
  switch (o.task) {
    case RecallTask::Mqar:
      if (V / 2 - 1 < P) throw error("recall", "mqar: vocab ", V, " has ", V / 2 - 1, " keys, fewer than ", P, " pairs");
      if ((T - 2 * P) / 2 < P)
        throw error("recall", "mqar: ", P, " pairs need seq-len >= ", 4 * P, " (pairs, then a query slot per key)");
      break;
    case RecallTask::Palindrome:
      if (2 * P + 1 > T) throw error("recall", "palindrome: reversing ", P, " tokens needs seq-len >= ", 2 * P + 1);
      if (V < 4) throw error("recall", "palindrome: vocab must be at least 4");
      break;
    case RecallTask::Stack:
      if (V < recall_tokens::kStackIdBase + P + 2)
        throw error("recall", "stack: vocab ", V, " leaves fewer than 2 values beside ", P, " stack ids");
      if (T < 6) throw error("recall", "stack: seq-len must be at least 6");
      break;
    case RecallTask::Overwrite:
    case RecallTask::Capacity:
      if (V < 6) throw error("recall", recall_task_name(o.task), ": vocab must be at least 6");
      if (o.task == RecallTask::Overwrite && P > V / 2 - 1)
        throw error("recall", "overwrite: vocab ", V, " has ", V / 2 - 1, " keys, fewer than ", P);
      break;
    case RecallTask::Niah:
      if (V < 16) throw error("recall", "niah: vocab must be at least 16");
      if (P > V / 4) throw error("recall", "niah: vocab ", V, " has ", V / 4, " keys, fewer than ", P, " needles");
      if (3 * P > T - 2) throw error("recall", "niah: ", P, " needles need seq-len >= ", 3 * P + 2);
      break;
  }
  return o;
}

int64_t RecallBatch::answers() const {
  return int64_t(std::count_if(targets.begin(), targets.end(), [](int64_t t) { return t >= 0; }));
}

void make_recall_example(const RecallTaskOptions& o, uint64_t seed, uint64_t index, int64_t* ids, int64_t* targets) {
  std::fill(ids, ids + o.seq_len, int64_t(0));
  std::fill(targets, targets + o.seq_len, int64_t(-1));
  Rng rng(mix(seed, index));
  switch (o.task) {
    case RecallTask::Mqar: mqar(o, rng, ids, targets); break;
    case RecallTask::Palindrome: palindrome(o, rng, ids, targets); break;
    case RecallTask::Stack: stack(o, rng, ids, targets); break;
    case RecallTask::Overwrite:
    case RecallTask::Capacity: key_stream(o, rng, ids, targets); break;
    case RecallTask::Niah: niah(o, rng, ids, targets); break;
  }
}

RecallBatch make_recall_batch(const RecallTaskOptions& o, uint64_t seed, uint64_t first, int64_t B) {
  RecallBatch b;
  b.B = B;
  b.T = o.seq_len;
  b.ids.resize(static_cast<size_t>(B * b.T));
  b.targets.resize(b.ids.size());
  for (int64_t i = 0; i < B; ++i)
    make_recall_example(o, seed, first + uint64_t(i), b.ids.data() + i * b.T, b.targets.data() + i * b.T);
  return b;
}

uint64_t recall_train_seed(uint64_t seed) { return mix(seed, 0x7261696eull); }
uint64_t recall_test_seed(uint64_t seed) { return mix(seed, 0x74657374ull); }

}  // namespace k3
