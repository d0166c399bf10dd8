#include "infer/serve/prefix_cache.h"

#include <algorithm>

namespace k3::serve {

uint64_t PrefixCache::hash(const int64_t* t, int64_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the ids' bytes
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v = uint64_t(t[i]);
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

PrefixCache::List::iterator PrefixCache::find_locked(const std::vector<int64_t>& tokens, int64_t len, uint64_t h) const {
  auto range = index_.equal_range(h);
  for (auto it = range.first; it != range.second; ++it) {
    const Entry& e = *it->second;
    if (int64_t(e.tokens.size()) == len && std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin())) return it->second;
  }
  return lru_.end();
}

int64_t PrefixCache::lookup(const std::vector<int64_t>& tokens, int64_t max_len, Context* out) {
  if (!enabled()) return 0;
  max_len = std::min<int64_t>(max_len, int64_t(tokens.size()));
  const int64_t nblocks = max_len / block_;
  std::lock_guard<std::mutex> lock(mu_);
  if (nblocks == 0) return 0;
  st_.lookups++;
  st_.lookup_tokens += int64_t(tokens.size());
  // Hashes of every block-aligned prefix, then the deepest one that is cached.
  std::vector<uint64_t> hs;
  hs.reserve(size_t(nblocks));
  for (int64_t k = 1; k <= nblocks; ++k) hs.push_back(hash(tokens.data(), k * block_));
  for (int64_t k = nblocks; k >= 1; --k) {
    auto it = find_locked(tokens, k * block_, hs[size_t(k - 1)]);
    if (it == lru_.end()) continue;
    lru_.splice(lru_.begin(), lru_, it);  // most recently used
    if (!it->kept) {
      it->kept = true;
      if (!it->on_host) kept_bytes_ += it->bytes;
      st_.kept++;
      // Kept entries hold at most 80 % of the budget: the least recently used goes back.
      for (auto r = lru_.rbegin(); kept_bytes_ > budget_ / 5 * 4 && r != lru_.rend(); ++r)
        if (r->kept && !r->on_host && &*r != &*it) {
          r->kept = false;
          kept_bytes_ -= r->bytes;
          st_.kept--;
        }
    }
    if (out) *out = it->on_host ? it->ctx.clone_to(it->device) : it->ctx.clone();
    st_.hits++;
    if (it->on_host) st_.host_hits++;
    std::array<size_t, 4> restored{};
    for (const auto& m : it->ctx.layers) restored[size_t(m->kind())] += m->bytes();
    for (size_t kind = 0; kind < restored.size(); ++kind)
      if (restored[kind]) st_.hits_by_kind[kind]++, st_.restored_bytes_by_kind[kind] += restored[kind];
    st_.hit_tokens += k * block_;
    return k * block_;
  }
  return 0;
}

bool PrefixCache::contains(const std::vector<int64_t>& tokens, int64_t len) const {
  if (!enabled() || len <= 0 || len > int64_t(tokens.size())) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return find_locked(tokens, len, hash(tokens.data(), len)) != lru_.end();
}

void PrefixCache::insert(const std::vector<int64_t>& tokens, int64_t len, const Context& ctx) {
  if (!enabled() || len <= 0 || len % block_ != 0 || len > int64_t(tokens.size())) return;
  const uint64_t h = hash(tokens.data(), len);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (find_locked(tokens, len, h) != lru_.end()) return;
  }
  if (ctx.bytes() > budget_) return;
  Entry e;  // the deep copy happens outside the lock
  e.tokens.assign(tokens.begin(), tokens.begin() + len);
  e.ctx = ctx.clone();
  if (!ctx.layers.empty()) e.device = ctx.layers.front()->device();
  for (const auto& m : e.ctx.layers) {
    size_t b = m->bytes();
    e.bytes += b;
    e.by_kind[size_t(m->kind())] += b;
  }
  e.bytes += e.tokens.size() * sizeof(int64_t);
  std::lock_guard<std::mutex> lock(mu_);
  if (find_locked(tokens, len, h) != lru_.end()) return;
  st_.bytes += e.bytes;
  for (size_t k = 0; k < 4; ++k) st_.bytes_by_kind[k] += e.by_kind[k];
  lru_.push_front(std::move(e));
  index_.emplace(h, lru_.begin());
  st_.inserts++;
  st_.entries++;
  evict_locked();
}

void PrefixCache::erase_locked(List::iterator e) {
  const uint64_t h = hash(e->tokens.data(), int64_t(e->tokens.size()));
  auto range = index_.equal_range(h);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second == e) {
      index_.erase(it);
      break;
    }
  if (e->on_host) {
    st_.host_bytes -= e->bytes;
    st_.host_entries--;
  } else {
    st_.bytes -= e->bytes;
    for (size_t k = 0; k < 4; ++k) st_.bytes_by_kind[k] -= e->by_kind[k];
    if (e->kept) kept_bytes_ -= e->bytes;
  }
  if (e->kept) st_.kept--;
  st_.entries--;
  st_.evictions++;
  lru_.erase(e);
}

PrefixCache::List::iterator PrefixCache::victim_locked(bool on_host) {
  List::iterator last = lru_.end();
  for (auto it = lru_.end(); it != lru_.begin();) {
    --it;
    if (it->on_host != on_host) continue;
    if (!it->kept) return it;
    if (last == lru_.end()) last = it;
  }
  return last;
}

void PrefixCache::spill_locked(List::iterator e) {
  // The copy down happens under the lock: the scheduler's thread is the one that waits on it.
  Context host = e->ctx.clone_to(Device::CPU);
  size_t b = e->tokens.size() * sizeof(int64_t);
  for (const auto& m : host.layers) b += m->bytes();
  st_.bytes -= e->bytes;
  for (size_t k = 0; k < 4; ++k) st_.bytes_by_kind[k] -= e->by_kind[k];
  if (e->kept) kept_bytes_ -= e->bytes;
  e->ctx = std::move(host);
  e->bytes = b;
  e->on_host = true;
  st_.host_bytes += b;
  st_.host_entries++;
  st_.spills++;
}

void PrefixCache::evict_locked() {
  while (st_.bytes > budget_) {
    auto victim = victim_locked(false);
    if (victim == lru_.end()) break;
    if (host_budget_ > 0 && victim->bytes <= host_budget_)
      spill_locked(victim);
    else
      erase_locked(victim);
  }
  while (st_.host_bytes > host_budget_) {
    auto victim = victim_locked(true);
    if (victim == lru_.end()) break;
    erase_locked(victim);
  }
}

void PrefixCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  lru_.clear();
  index_.clear();
  st_.bytes = 0;
  st_.bytes_by_kind = {};
  st_.host_bytes = 0;
  st_.host_entries = 0;
  st_.entries = 0;
  st_.kept = 0;
  kept_bytes_ = 0;
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return st_;
}

}  // namespace k3::serve
