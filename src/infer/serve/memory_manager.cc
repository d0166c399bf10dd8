#include "infer/serve/memory_manager.h"

#include <cmath>

#include "core/error.h"

namespace k3::serve {

MemoryManager::MemoryManager(const std::vector<LayerMemory>& layers, size_t budget, int64_t page_tokens)
    : page_tokens_(page_tokens), budget_(budget) {
  if (page_tokens < 1) throw error("serve", "the memory page must hold at least one token, got ", page_tokens);
  std::array<double, 4> per_token{}, fixed{};
  for (const auto& l : layers) {
    per_token[size_t(l.spec.kind)] += l.spec.per_token_bytes;
    fixed[size_t(l.spec.kind)] += l.spec.fixed_bytes;
  }
  for (size_t k = 0; k < 4; ++k) {
    page_bytes_[k] = size_t(std::ceil(per_token[k] * double(page_tokens)));
    fixed_bytes_[k] = size_t(std::ceil(fixed[k]));
    page_set_ += page_bytes_[k];
    fixed_set_ += fixed_bytes_[k];
  }
}

bool MemoryManager::admit(Account& a, int64_t tokens) {
  K3_CHECK(!a.admitted, "MemoryManager::admit: the sequence is admitted already");
  const int64_t pages = pages_for(tokens);
  const size_t need = fixed_set_ + size_t(pages) * page_set_;
  if (used_ + need > budget_) return false;
  used_ += need;
  pages_ += pages;
  sequences_++;
  a = {pages, true};
  return true;
}

bool MemoryManager::grow(Account& a, int64_t tokens) {
  K3_CHECK(a.admitted, "MemoryManager::grow: the sequence is not admitted");
  const int64_t more = pages_for(tokens) - a.pages;
  if (more <= 0) return true;
  const size_t need = size_t(more) * page_set_;
  if (used_ + need > budget_) return false;
  used_ += need;
  pages_ += more;
  a.pages += more;
  return true;
}

void MemoryManager::release(Account& a) {
  if (!a.admitted) return;
  used_ -= fixed_set_ + size_t(a.pages) * page_set_;
  pages_ -= a.pages;
  sequences_--;
  a = {};
}

MemoryStats MemoryManager::stats() const {
  MemoryStats s;
  s.page_tokens = page_tokens_;
  s.budget = budget_;
  s.used = used_;
  s.sequences = sequences_;
  const int64_t free_sets = page_set_ ? int64_t((budget_ - used_) / page_set_) : 0;
  for (size_t k = 0; k < 4; ++k) {
    s.bytes_used[k] = size_t(sequences_) * fixed_bytes_[k] + size_t(pages_) * page_bytes_[k];
    s.page_bytes[k] = page_bytes_[k];
    if (page_bytes_[k] == 0) continue;
    s.pages_used[k] = pages_;
    s.pages_free[k] = free_sets;
  }
  return s;
}

}  // namespace k3::serve
