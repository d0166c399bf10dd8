// State-aware prefix cache for `k3 serve`. A recurrent state cannot be truncated, so the cache
// keeps whole Context snapshots (every Memory of every stateful layer: KV caches, latent caches,
// recurrent states, conv tails) taken at block boundaries (every `block` prompt tokens). A new
// request resumes from the deepest snapshot whose token prefix equals the start of its prompt.
// Entries stay under a byte budget by segmented LRU: an entry that has served a hit is kept
// (protected) and is evicted only when no entry that never served one is left, so a stream of
// one-off prompts cannot flush the prefixes that are shared; kept entries are held to 80 % of
// the budget (the least recently used one goes back to probation past that).
// With a host tier (host_budget > 0), an entry evicted from the budget above moves to host memory
// instead of being dropped (a device snapshot is copied down, holding only the tokens absorbed);
// a hit on it copies the snapshot back to the device for the new request, and the host tier keeps
// it. The host tier evicts by the same rule under its own budget. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "mixers/memory.h"

namespace k3::serve {

struct PrefixCacheStats {
  int64_t lookups = 0, hits = 0;           // lookups: prompts at least one block + 1 long
  int64_t hit_tokens = 0, lookup_tokens = 0;  // prompt tokens served from the cache / looked up
  int64_t inserts = 0, evictions = 0, entries = 0;
  int64_t kept = 0;                         // entries that have served a hit (protected)
  size_t bytes = 0;                         // the first tier's entries (on the model's device)
  std::array<size_t, 4> bytes_by_kind{};   // indexed by MemoryKind
  // The host tier: entries moved there (spills), hits served from it, and what it holds.
  int64_t spills = 0, host_hits = 0, host_entries = 0;
  size_t host_bytes = 0;
  // Hits that restored memories of each kind, and the bytes they restored. A snapshot holds every
  // layer's memory, so a hit counts once for each kind the model has; the bytes tell the kinds
  // apart (a fixed-size state costs the same at every prefix length, a cache grows with it).
  std::array<int64_t, 4> hits_by_kind{};
  std::array<size_t, 4> restored_bytes_by_kind{};
  double hit_rate() const { return lookups ? double(hits) / double(lookups) : 0.0; }
};

class PrefixCache {
 public:
  PrefixCache(int64_t block, size_t budget_bytes, size_t host_budget_bytes = 0)
      : block_(block), budget_(budget_bytes), host_budget_(host_budget_bytes) {}
  int64_t block() const { return block_; }
  bool enabled() const { return block_ > 0 && budget_ > 0; }

  // The longest cached prefix of tokens[0, n) with n <= max_len (a multiple of block). On a hit
  // *out becomes a deep copy of the snapshot (on the device it was taken on) and its length is
  // returned; 0 on a miss.
  int64_t lookup(const std::vector<int64_t>& tokens, int64_t max_len, Context* out);
  // Stores a snapshot (deep copy) of ctx, which has absorbed tokens[0, len). len must be a
  // multiple of block. No-op if that prefix is cached already or the snapshot exceeds the budget.
  void insert(const std::vector<int64_t>& tokens, int64_t len, const Context& ctx);
  bool contains(const std::vector<int64_t>& tokens, int64_t len) const;
  void clear();
  PrefixCacheStats stats() const;

 private:
  struct Entry {
    std::vector<int64_t> tokens;  // the prefix itself (hash collisions are checked against it)
    Context ctx;
    size_t bytes = 0;
    std::array<size_t, 4> by_kind{};
    bool kept = false;  // has served a hit
    bool on_host = false;  // in the host tier
    Device device = Device::CPU;  // where the snapshot was taken, and where hits restore it
  };
  using List = std::list<Entry>;
  static uint64_t hash(const int64_t* t, int64_t n);
  List::iterator find_locked(const std::vector<int64_t>& tokens, int64_t len, uint64_t h) const;
  void evict_locked();
  void erase_locked(List::iterator e);
  void spill_locked(List::iterator e);  // to the host tier
  // The least recently used entry of a tier that never served a hit; else its least recently used.
  List::iterator victim_locked(bool on_host);
  size_t kept_bytes_ = 0;

  int64_t block_;
  size_t budget_, host_budget_;
  mutable std::mutex mu_;
  mutable List lru_;  // front = most recently used
  std::unordered_multimap<uint64_t, List::iterator> index_;
  PrefixCacheStats st_;
};

}  // namespace k3::serve
