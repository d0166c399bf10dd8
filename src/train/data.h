// Training data: text files (or a folder of them) tokenized once into a memory-mapped token
// cache; the last `val_fraction` of the tokens is the validation split; batches of length T start
// at offsets drawn from a generator seeded by (seed, step), so a resumed run sees exactly the
// batches the uninterrupted one would have seen.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/bpe.h"

namespace k3 {

enum class Split : uint8_t { Train, Val };

class TokenData {
 public:
  // Tokenizes `paths` (files, or folders searched for *.txt recursively) with `tok`, caching the
  // result under cache_dir keyed by the files' names, sizes, mtimes and the tokenizer; a second
  // call maps the cache. Documents (files) are separated by the tokenizer's EOS when it has one.
  static TokenData build(const std::vector<std::string>& paths, const Tokenizer& tok, const std::string& cache_dir,
                         double val_fraction = 0.05);
  static TokenData from_tokens(std::vector<int32_t> tokens, double val_fraction = 0.05);

  int64_t size(Split s) const { return s == Split::Train ? n_train_ : n_total_ - n_train_; }
  const int32_t* tokens(Split s) const { return data_ + (s == Split::Train ? 0 : n_train_); }
  bool from_cache() const { return from_cache_; }

  // B sequences of T inputs and their next-token targets ([B*T] each), for (seed, step).
  void batch(Split s, int64_t B, int64_t T, uint64_t seed, int64_t step, std::vector<int64_t>& ids,
             std::vector<int64_t>& targets) const;
  // Unigram entropy of the train split (nats/token), measured on the validation split: the loss
  // of a model that ignores context, the baseline a trained model must beat.
  double unigram_baseline(int64_t vocab) const;

 private:
  std::shared_ptr<const void> owner_;
  const int32_t* data_ = nullptr;
  int64_t n_total_ = 0, n_train_ = 0;
  bool from_cache_ = false;
};

// All files a data path names: the file itself, or every regular *.txt under a folder, sorted.
std::vector<std::string> list_text_files(const std::vector<std::string>& paths);

}  // namespace k3
