#include "tokenizer/bpe_train.h"

#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/pretokenize.h"

namespace k3 {

Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& opts) {
  const int32_t n_special = int32_t(opts.specials.size());
  if (opts.vocab_size < 256 + n_special)
    throw error("tokenizer", "vocab size ", opts.vocab_size, " is below the 256 byte tokens + ", n_special, " specials");
  // Unique pre-tokenized words with their counts.
  std::unordered_map<std::string, int64_t> word_count;
  for (const auto& t : texts)
    for (std::string_view piece : tok::split_gpt2(t)) ++word_count[std::string(piece)];
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> counts;
  words.reserve(word_count.size());
  {
    std::vector<std::pair<std::string, int64_t>> sorted(word_count.begin(), word_count.end());
    std::sort(sorted.begin(), sorted.end());  // deterministic order
    for (const auto& [w, c] : sorted) {
      std::vector<int32_t> ids;
      for (unsigned char ch : w) ids.push_back(int32_t(ch));
      words.push_back(std::move(ids));
      counts.push_back(c);
    }
  }
  std::vector<std::string> token(256);
  for (int i = 0; i < 256; ++i) token[size_t(i)] = std::string(1, char(i));
  BpeVocab vocab;
  const int32_t merges_wanted = opts.vocab_size - 256 - n_special;
  std::unordered_map<uint64_t, int64_t> pairs;
  for (int32_t m = 0; m < merges_wanted; ++m) {
    pairs.clear();
    for (size_t w = 0; w < words.size(); ++w)
      for (size_t i = 0; i + 1 < words[w].size(); ++i)
        pairs[(uint64_t(uint32_t(words[w][i])) << 32) | uint32_t(words[w][i + 1])] += counts[w];
    if (pairs.empty()) break;  // the corpus is fully merged: a smaller vocabulary results
    uint64_t best = 0;
    int64_t best_count = -1;
    auto bytes_of = [&](uint64_t key) { return token[size_t(key >> 32)] + token[size_t(key & 0xffffffffu)]; };
    for (const auto& [key, c] : pairs)
      if (c > best_count || (c == best_count && bytes_of(key) < bytes_of(best))) {
        best = key;
        best_count = c;
      }
    const int32_t l = int32_t(best >> 32), r = int32_t(best & 0xffffffffu);
    const int32_t id = int32_t(token.size());
    token.push_back(token[size_t(l)] + token[size_t(r)]);
    vocab.merges.push_back({token[size_t(l)], token[size_t(r)]});
    for (auto& w : words) {
      if (w.size() < 2) continue;
      size_t out = 0;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == l && w[i + 1] == r) {
          w[out++] = id;
          ++i;
        } else {
          w[out++] = w[i];
        }
      }
      w.resize(out);
    }
  }
  for (size_t i = 0; i < token.size(); ++i) vocab.tokens.push_back({token[i], int32_t(i)});
  for (const auto& s : opts.specials) vocab.specials.push_back({s, int32_t(vocab.tokens.size() + vocab.specials.size())});
  if (!opts.specials.empty()) vocab.eos = opts.specials.front();
  return Tokenizer::from_vocab(vocab, "trained BPE");
}

}  // namespace k3
