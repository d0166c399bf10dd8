// Tokenizer core: tables built from a BpeVocab, encode (special tokens, pre-tokenizer, BPE
// merges), decode, StreamDecoder. File formats live in hf_files.cc.
#include "tokenizer/bpe.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/split.h"

namespace k3 {

namespace {

constexpr uint32_t kNoRank = UINT32_MAX;
constexpr int32_t kMaxId = (1 << 24) - 1;
constexpr size_t kSmallPiece = 96;  // longer pieces merge with a heap, O(n log n)

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using BytesToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct Merge {
  uint32_t rank = kNoRank;
  int32_t id = -1;
};

// (left id, right id) -> the token their concatenation makes. Open addressing, linear probing.
class PairTable {
 public:
  void build(const std::vector<std::pair<uint64_t, Merge>>& entries) {
    size_t cap = 16;
    while (cap < entries.size() * 2) cap *= 2;
    keys_.assign(cap, kEmpty);
    values_.assign(cap, Merge{});
    mask_ = cap - 1;
    for (const auto& [key, merge] : entries) {
      size_t i = slot(key);
      while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
      keys_[i] = key;
      values_[i] = merge;
    }
  }
  Merge find(int32_t left, int32_t right) const {
    const uint64_t key = make_key(left, right);
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return values_[i];
      if (keys_[i] == kEmpty) return Merge{};
    }
  }
  static uint64_t make_key(int32_t left, int32_t right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  size_t slot(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  std::vector<uint64_t> keys_;
  std::vector<Merge> values_;
  size_t mask_ = 0;
};

enum class Kind : uint8_t { kHole, kOrdinary, kSpecial };

// Results of BPE for pieces that are not whole tokens, one cache per thread (no locks on the hot
// path), for the tokenizer it last served (tokenizers are told apart by a unique number, not by an
// address that could be reused). Bounded: emptied when it reaches kCacheEntries.
constexpr size_t kCacheEntries = 1 << 16;
constexpr size_t kCacheMaxPiece = 64;  // longer pieces are rare and rarely repeat

struct PieceCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>> map;  // -> ids span
  std::vector<int32_t> ids;
};

PieceCache& thread_cache(uint64_t owner) {
  thread_local PieceCache cache;
  if (cache.owner != owner || cache.map.size() >= kCacheEntries || cache.ids.size() >= 4 * kCacheEntries) {
    cache.owner = owner;
    cache.map.clear();
    cache.ids.clear();
  }
  return cache;
}

std::atomic<uint64_t> next_tokenizer_uid{1};

}  // namespace

struct Tokenizer::Impl {
  uint64_t uid = next_tokenizer_uid.fetch_add(1);
  std::string origin;
  // id -> bytes: token i is blob[offsets[i], offsets[i+1]).
  std::string blob;
  std::vector<uint32_t> offsets;
  std::vector<Kind> kinds;
  BytesToId encoder;  // ordinary tokens only
  std::array<int32_t, 256> byte_id{};
  PairTable pairs;
  std::vector<std::pair<int32_t, int32_t>> merges;  // rank order, kept for saving
  std::vector<SpecialToken> specials;               // longest first
  std::array<bool, 256> special_first{};            // first bytes of the specials
  std::optional<int32_t> eos;
  std::shared_ptr<const tok::TextPipeline> pipeline;  // null: GPT-2's split
  bool listed_merges_only = false, whole_piece_first = true;

  std::string_view bytes_of(int32_t id) const { return {blob.data() + offsets[id], offsets[id + 1] - offsets[id]}; }
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void merge(std::string_view piece, std::vector<int32_t>& out) const;
  void merge_small(std::string_view piece, std::vector<int32_t>& out) const;
  void merge_large(std::string_view piece, std::vector<int32_t>& out) const;
};

Tokenizer Tokenizer::from_vocab(const BpeVocab& v, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  Impl& m = *impl;
  m.origin = origin;
  auto fail = [&](auto&&... parts) -> Error {
    return error("tokenizer", origin, ": ", std::forward<decltype(parts)>(parts)...);
  };

  // Ids: in range, unique, dense enough to index a table.
  const size_t n_entries = v.tokens.size() + v.specials.size();
  int32_t max_id = -1;
  auto check_id = [&](int32_t id, std::string_view what) {
    if (id < 0 || id > kMaxId) throw fail("token ", tok::escape_bytes(what), " has id ", id, ", outside [0, ", kMaxId, "]");
    max_id = std::max(max_id, id);
  };
  for (const auto& [bytes, id] : v.tokens) check_id(id, bytes);
  for (const auto& s : v.specials) check_id(s.id, s.text);
  if (max_id < 0) throw fail("the vocabulary is empty; a byte-level BPE vocabulary has at least the 256 byte tokens");
  if (size_t(max_id) > 2 * n_entries + 1024)
    throw fail("token ids are too sparse (largest id ", max_id, " for ", n_entries,
               " tokens); ids should number the vocabulary from 0");

  m.kinds.assign(size_t(max_id) + 1, Kind::kHole);
  std::vector<std::string_view> by_id(size_t(max_id) + 1);
  m.encoder.reserve(v.tokens.size());
  for (const auto& [bytes, id] : v.tokens) {
    if (bytes.empty()) throw fail("token id ", id, " is empty");
    if (m.kinds[id] != Kind::kHole)
      throw fail("tokens ", tok::escape_bytes(by_id[id]), " and ", tok::escape_bytes(bytes), " share id ", id);
    if (!m.encoder.emplace(bytes, id).second)
      throw fail("token ", tok::escape_bytes(bytes), " appears twice (ids ", m.encoder.find(bytes)->second, " and ", id, ")");
    m.kinds[id] = Kind::kOrdinary;
    by_id[id] = bytes;
  }
  for (const auto& s : v.specials) {
    if (s.text.empty()) throw fail("special token id ", s.id, " has empty text");
    if (m.kinds[s.id] != Kind::kHole)
      throw fail("special token ", tok::escape_bytes(s.text), " has id ", s.id, ", already used by ", tok::escape_bytes(by_id[s.id]));
    m.kinds[s.id] = Kind::kSpecial;
    by_id[s.id] = s.text;
    m.specials.push_back(s);
    m.special_first[uint8_t(s.text[0])] = true;
  }
  std::stable_sort(m.specials.begin(), m.specials.end(),
                   [](const SpecialToken& a, const SpecialToken& b) { return a.text.size() > b.text.size(); });
  std::unordered_set<std::string_view> special_texts;
  for (const SpecialToken& s : m.specials)
    if (!special_texts.insert(s.text).second) throw fail("special token ", tok::escape_bytes(s.text), " appears twice");

  size_t total = 0;
  for (const std::string_view b : by_id) total += b.size();
  if (total >= UINT32_MAX) throw fail("the tokens hold ", total, " bytes in all, more than 4 GiB");
  m.blob.reserve(total);
  m.offsets.resize(by_id.size() + 1);
  for (size_t i = 0; i < by_id.size(); ++i) {
    m.offsets[i] = uint32_t(m.blob.size());
    m.blob += by_id[i];
  }
  m.offsets.back() = uint32_t(m.blob.size());

  for (int b = 0; b < 256; ++b) {
    const auto it = m.encoder.find(std::string_view(std::string(1, char(b))));
    if (it == m.encoder.end())
      throw fail("byte 0x", std::hex, b, std::dec, " (byte-level character '", tok::byte_level_encode(std::string(1, char(b))),
                 "') has no token; a byte-level BPE vocabulary must cover all 256 bytes");
    m.byte_id[b] = it->second;
  }

  // Ranks: the index of the first merge that makes a token. As in tiktoken, any two adjacent parts
  // whose concatenation is a ranked token can merge, whatever split the merge list names.
  std::vector<uint32_t> rank(m.kinds.size(), kNoRank);
  m.merges.reserve(v.merges.size());
  for (size_t r = 0; r < v.merges.size(); ++r) {
    const auto& [left, right] = v.merges[r];
    const auto l = m.encoder.find(left), rt = m.encoder.find(right), both = m.encoder.find(left + right);
    if (l == m.encoder.end() || rt == m.encoder.end() || both == m.encoder.end())
      throw fail("merge #", r, " (", tok::escape_bytes(left), " + ", tok::escape_bytes(right), ") names a token that is not in ",
                 "the vocabulary: ", tok::escape_bytes(l == m.encoder.end() ? left : rt == m.encoder.end() ? right : left + right));
    m.merges.emplace_back(l->second, rt->second);
    if (rank[both->second] == kNoRank) rank[both->second] = uint32_t(r);
  }
  std::vector<std::pair<uint64_t, Merge>> entries;
  m.pipeline = v.pipeline;
  m.listed_merges_only = v.listed_merges_only;
  m.whole_piece_first = !v.listed_merges_only || v.ignore_merges;
  if (v.listed_merges_only) {  // Hugging Face: the listed pairs, each at its own rank
    for (size_t r = 0; r < m.merges.size(); ++r)
      entries.emplace_back(PairTable::make_key(m.merges[r].first, m.merges[r].second),
                           Merge{uint32_t(r), m.encoder.find(std::string(m.bytes_of(m.merges[r].first)) +
                                                             std::string(m.bytes_of(m.merges[r].second)))->second});
    // The first listing of a pair wins (PairTable keeps the last it is given).
    std::reverse(entries.begin(), entries.end());
  }
  for (const auto& [bytes, id] : v.tokens) {
    if (v.listed_merges_only) break;
    if (rank[id] == kNoRank) continue;
    const std::string_view s = bytes;
    for (size_t k = 1; k < s.size(); ++k) {
      const auto l = m.encoder.find(s.substr(0, k)), r = m.encoder.find(s.substr(k));
      if (l == m.encoder.end() || r == m.encoder.end()) continue;
      entries.emplace_back(PairTable::make_key(l->second, r->second), Merge{rank[id], id});
    }
  }
  m.pairs.build(entries);

  if (!v.eos.empty()) {
    std::optional<int32_t> id;
    for (const auto& s : m.specials)
      if (s.text == v.eos) id = s.id;
    if (!id) {
      const auto it = m.encoder.find(v.eos);
      if (it == m.encoder.end()) throw fail("the EOS token ", tok::escape_bytes(v.eos), " is not in the vocabulary");
      id = it->second;
    }
    m.eos = id;
  } else {
    for (const auto& s : m.specials)
      if (s.text == "<|endoftext|>") m.eos = s.id;
    if (!m.eos && m.specials.size() == 1) m.eos = m.specials[0].id;
  }
  return Tokenizer(std::move(impl));
}

BpeVocab Tokenizer::to_vocab() const {
  const Impl& m = *impl_;
  BpeVocab v;
  for (int32_t id = 0; id < vocab_size(); ++id)
    if (m.kinds[id] == Kind::kOrdinary) v.tokens.emplace_back(std::string(m.bytes_of(id)), id);
  for (const auto& [l, r] : m.merges) v.merges.emplace_back(std::string(m.bytes_of(l)), std::string(m.bytes_of(r)));
  v.specials = m.specials;
  std::sort(v.specials.begin(), v.specials.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  if (m.eos) v.eos = std::string(m.bytes_of(*m.eos));
  v.pipeline = m.pipeline;
  v.listed_merges_only = m.listed_merges_only;
  v.ignore_merges = m.listed_merges_only && m.whole_piece_first;
  return v;
}

// ---- encode ------------------------------------------------------------------------------------

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_id[uint8_t(piece[0])]);
    return;
  }
  if (whole_piece_first)
    if (const auto it = encoder.find(piece); it != encoder.end()) {  // a whole token maps directly
      out.push_back(it->second);
      return;
    }
  if (piece.size() > kCacheMaxPiece) return merge(piece, out);
  PieceCache& cache = thread_cache(uid);
  if (const auto it = cache.map.find(piece); it != cache.map.end()) {
    const auto [offset, count] = it->second;
    out.insert(out.end(), cache.ids.begin() + offset, cache.ids.begin() + offset + count);
    return;
  }
  const size_t first = out.size();
  merge(piece, out);
  cache.map.emplace(piece, std::pair<uint32_t, uint32_t>(uint32_t(cache.ids.size()), uint32_t(out.size() - first)));
  cache.ids.insert(cache.ids.end(), out.begin() + first, out.end());
}

void Tokenizer::Impl::merge(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() <= kSmallPiece) {
    merge_small(piece, out);
  } else {
    merge_large(piece, out);
  }
}

// tiktoken's byte_pair_merge: repeatedly merge the adjacent pair of lowest rank, leftmost first.
void Tokenizer::Impl::merge_small(std::string_view piece, std::vector<int32_t>& out) const {
  int32_t ids[kSmallPiece];
  Merge next[kSmallPiece];  // next[i]: what merging parts i and i+1 gives
  size_t n = piece.size();
  for (size_t i = 0; i < n; ++i) ids[i] = byte_id[uint8_t(piece[i])];
  for (size_t i = 0; i + 1 < n; ++i) next[i] = pairs.find(ids[i], ids[i + 1]);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (next[i].rank < next[best].rank) best = i;
    if (next[best].rank == kNoRank) break;
    ids[best] = next[best].id;
    std::memmove(ids + best + 1, ids + best + 2, (n - best - 2) * sizeof(int32_t));
    if (n >= best + 3) std::memmove(next + best + 1, next + best + 2, (n - best - 3) * sizeof(Merge));
    --n;
    if (best > 0) next[best - 1] = pairs.find(ids[best - 1], ids[best]);
    if (best + 1 < n) next[best] = pairs.find(ids[best], ids[best + 1]);
  }
  out.insert(out.end(), ids, ids + n);
}

// The same merges in the same order for long pieces: a heap of candidate pairs ordered by (rank,
// position), stale entries skipped when popped.
void Tokenizer::Impl::merge_large(std::string_view piece, std::vector<int32_t>& out) const {
  const int32_t n = int32_t(piece.size());
  std::vector<int32_t> ids(n), prev(n), nxt(n);
  for (int32_t i = 0; i < n; ++i) {
    ids[i] = byte_id[uint8_t(piece[i])];
    prev[i] = i - 1;
    nxt[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    uint32_t rank;
    int32_t pos, left, right, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](int32_t pos) {
    if (pos < 0 || nxt[pos] < 0) return;
    const Merge m = pairs.find(ids[pos], ids[nxt[pos]]);
    if (m.rank != kNoRank) heap.push({m.rank, pos, ids[pos], ids[nxt[pos]], m.id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) offer(i);
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const int32_t right = nxt[c.pos];
    if (!alive[c.pos] || right < 0 || ids[c.pos] != c.left || ids[right] != c.right) continue;
    ids[c.pos] = c.merged;
    alive[right] = false;
    nxt[c.pos] = nxt[right];
    if (nxt[right] >= 0) prev[nxt[right]] = c.pos;
    offer(prev[c.pos]);
    offer(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = nxt[i]) out.push_back(ids[i]);
}

void Tokenizer::encode_ordinary_into(std::string_view text, std::vector<int32_t>& out, size_t limit) const {
  if (impl_->pipeline) {
    std::string normalized;
    std::vector<std::string_view> pieces;
    impl_->pipeline->split(text, normalized, pieces);
    for (std::string_view piece : pieces) {
      if (out.size() > limit) break;
      impl_->encode_piece(piece, out);
    }
    return;
  }
  tok::Gpt2Splitter splitter(text);
  while (out.size() <= limit)
    if (const auto piece = splitter.next()) impl_->encode_piece(*piece, out);
    else break;
}

void Tokenizer::encode_into(std::string_view text, std::vector<int32_t>& out, size_t limit) const {
  const Impl& m = *impl_;
  if (m.specials.empty()) return encode_ordinary_into(text, out, limit);
  size_t start = 0;  // the ordinary text not yet encoded starts here
  for (size_t pos = 0; pos < text.size(); ++pos) {
    if (!m.special_first[uint8_t(text[pos])]) continue;
    for (const SpecialToken& s : m.specials) {  // longest first
      if (text.compare(pos, s.text.size(), s.text) != 0) continue;
      encode_ordinary_into(text.substr(start, pos - start), out, limit);
      if (out.size() > limit) return;
      out.push_back(s.id);
      start = pos + s.text.size();
      pos = start - 1;
      break;
    }
  }
  encode_ordinary_into(text.substr(start), out, limit);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode_into(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode_ordinary_into(text, out);
  return out;
}

// ---- decode and lookups ------------------------------------------------------------------------

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= vocab_size() || m.kinds[id] == Kind::kHole)
    throw error("tokenizer", "token id ", id, " names no token of ", m.origin, " (vocab_size ", vocab_size(),
                "); was it produced by another tokenizer?");
  return std::string(m.bytes_of(id));
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& m = *impl_;
  std::string out;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || m.kinds[id] == Kind::kHole) token_bytes(id);  // throws
    out += m.bytes_of(id);
  }
  return out;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->kinds.size()); }

std::optional<int32_t> Tokenizer::special_id(std::string_view text) const {
  for (const auto& s : impl_->specials)
    if (s.text == text) return s.id;
  return std::nullopt;
}

const std::vector<SpecialToken>& Tokenizer::specials() const { return impl_->specials; }

std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_->token_bytes(id);
  const size_t keep = tok::utf8_incomplete_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return ready;
}

std::string StreamDecoder::flush() { return std::exchange(pending_, std::string()); }

}  // namespace k3
