// Byte-level BPE training (`k3 tokenizer train`): the corpus is split with the GPT-2
// pre-tokenizer, then the most frequent adjacent pair of tokens is merged, vocab_size − 256 −
// (number of specials) times. The result loads like any byte-level BPE and saves as an HF
// tokenizer.json.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/bpe.h"

namespace k3 {

struct BpeTrainOptions {
  int32_t vocab_size = 1024;                              // including the 256 byte tokens and specials
  std::vector<std::string> specials = {"<|endoftext|>"};  // appended after the merges; the first is EOS
};

// `texts` are the documents (files' contents). Deterministic: ties between equally frequent pairs
// go to the pair whose bytes sort first.
Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& opts);

}  // namespace k3
