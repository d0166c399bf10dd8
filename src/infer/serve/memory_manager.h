// The memory manager of `k3 serve`: the running sequences' memory, accounted against one byte
// budget, kind by kind (mixers/memory.h). Sizes come from the model's memory specs
// (Mixer::memory_spec), not from measuring contexts.
//
// - Memories that grow with the context (KV caches, MLA latent caches) are taken in pages of
//   `page_tokens` tokens as a sequence grows; a page of a kind spans every layer of that kind
//   (vLLM's block), so a sequence holding T tokens holds ceil(T / page_tokens) pages of each
//   growing kind.
// - Fixed memories (recurrent states, conv tails) are reserved whole when a sequence is admitted.
//
// The budget bounds what the pages and reservations add up to. The buffers behind them grow
// geometrically (KVCache doubles, LatentCache is a std::vector), so a context's allocation can
// run up to twice its pages until it reaches a power of two. Not thread-safe: the scheduler
// calls it under its lock.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "blocks/stack.h"

namespace k3::serve {

struct MemoryStats {
  int64_t page_tokens = 0;
  size_t budget = 0, used = 0;          // bytes
  int64_t sequences = 0;                // admitted
  std::array<size_t, 4> page_bytes{};   // by MemoryKind; 0 for the kinds that do not grow
  std::array<int64_t, 4> pages_used{};  // growing kinds only
  // Pages of each growing kind that the free bytes still hold: a sequence takes one page of every
  // growing kind at a time, so the free bytes are divided by the bytes of such a page set.
  std::array<int64_t, 4> pages_free{};
  std::array<size_t, 4> bytes_used{};   // pages + fixed reservations, by MemoryKind
};

class MemoryManager {
 public:
  // One sequence's holding.
  struct Account {
    int64_t pages = 0;  // of each growing kind
    bool admitted = false;
  };

  MemoryManager(const std::vector<LayerMemory>& layers, size_t budget, int64_t page_tokens = 16);

  int64_t page_tokens() const { return page_tokens_; }
  int64_t pages_for(int64_t tokens) const { return (tokens + page_tokens_ - 1) / page_tokens_; }
  size_t page_bytes(MemoryKind k) const { return page_bytes_[size_t(k)]; }
  size_t fixed_bytes(MemoryKind k) const { return fixed_bytes_[size_t(k)]; }
  size_t page_set_bytes() const { return page_set_; }  // one page of every growing kind
  size_t fixed_set_bytes() const { return fixed_set_; }
  // What a sequence of `tokens` tokens holds: its fixed memories and its pages.
  size_t bytes_for(int64_t tokens) const { return fixed_set_ + size_t(pages_for(tokens)) * page_set_; }
  size_t budget() const { return budget_; }

  // Reserves a new sequence's fixed memories and the pages for its first `tokens` tokens. False
  // (nothing taken) when they are not free.
  bool admit(Account& a, int64_t tokens);
  // Takes the pages for the sequence to hold `tokens` tokens. False (nothing taken) when the
  // budget has no room for them.
  bool grow(Account& a, int64_t tokens);
  void release(Account& a);  // gives everything back; a no-op for an account not admitted
  MemoryStats stats() const;

 private:
  int64_t page_tokens_;
  size_t budget_, used_ = 0;
  std::array<size_t, 4> page_bytes_{}, fixed_bytes_{};
  size_t page_set_ = 0, fixed_set_ = 0;
  int64_t sequences_ = 0, pages_ = 0;  // pages: per growing kind, summed over sequences
};

}  // namespace k3::serve
