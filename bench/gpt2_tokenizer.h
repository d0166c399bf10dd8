// GPT-2's tokenizer for the benchmark programs, read once from $K3_SHARED_DIR/data/gpt2
// (environment variable, else the compile definition K3_SHARED_DIR).
#pragma once

#include <cstdlib>
#include <string>

#include "tokenizer/bpe.h"

#ifndef K3_SHARED_DIR
#define K3_SHARED_DIR "../shared"
#endif

inline const k3::Tokenizer& gpt2_tokenizer() {
  static const k3::Tokenizer tok = [] {
    const char* env = std::getenv("K3_SHARED_DIR");
    const std::string dir = std::string(env ? env : K3_SHARED_DIR) + "/data/gpt2";
    return k3::Tokenizer::from_gpt2_files(dir + "/encoder.json", dir + "/vocab.bpe");
  }();
  return tok;
}
