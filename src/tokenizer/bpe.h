// Byte-level BPE tokenizer, token-for-token equal to tiktoken's "gpt2" encoding (README.md in this
// folder: the algorithm, the rule for invalid UTF-8, and what is and is not read from HF files).
//
//   k3::Tokenizer tok = k3::Tokenizer::from_dir("models/gpt2");
//   std::vector<int32_t> ids = tok.encode("Hello world<|endoftext|>");
//   std::string bytes = tok.decode(ids);                 // == the input, for any byte string
//
// A Tokenizer is immutable after loading; copies share its tables, and every const method may be
// called from many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace k3 {

namespace tok {
class TextPipeline;
}

// A token matched verbatim in the text before pre-tokenization, e.g. <|endoftext|>.
struct SpecialToken {
  std::string text;
  int32_t id = -1;
};

// Everything a byte-level BPE tokenizer is made of, with raw bytes (not the byte-level alphabet).
// What the file loaders produce, and what a BPE trainer hands to Tokenizer::from_vocab.
struct BpeVocab {
  std::vector<std::pair<std::string, int32_t>> tokens;       // ordinary tokens: bytes, id
  std::vector<std::pair<std::string, std::string>> merges;   // in rank order: left, right
  std::vector<SpecialToken> specials;
  std::string eos;  // text of the special token that ends a document; "" = guess (see eos_id)
  // How text becomes pieces: null for GPT-2's split; else a tokenizer.json normalizer and
  // pre-tokenizer, or a tiktoken pattern (split.h).
  std::shared_ptr<const tok::TextPipeline> pipeline;
  // Which adjacent parts may merge. tiktoken's rule (false): any two whose concatenation is a
  // ranked token, and a piece that is a whole token maps to it at once. Hugging Face's (true): only
  // the pairs the merge list names, and a whole-token piece maps at once only with ignore_merges.
  bool listed_merges_only = false;
  bool ignore_merges = false;
};

class Tokenizer {
 public:
  // OpenAI's GPT-2 files: encoder.json (byte-level string -> id) and vocab.bpe (merges).
  static Tokenizer from_gpt2_files(const std::string& encoder_json_path, const std::string& vocab_bpe_path);
  // Hugging Face's vocab.json + merges.txt (the same two formats under other names).
  static Tokenizer from_hf_vocab_merges(const std::string& vocab_json_path, const std::string& merges_txt_path);
  // Hugging Face's tokenizer.json, byte-level BPE models (model.type "BPE", a ByteLevel decoder),
  // with the normalizers and pre-tokenizers of split.h; added_tokens become special tokens.
  static Tokenizer from_hf_tokenizer_json(const std::string& path);
  // tiktoken's format (each line: a token's bytes in base64 and its rank, which is its id), with
  // the split pattern and special tokens, which tiktoken keeps outside the file.
  static Tokenizer from_tiktoken_file(const std::string& path, const std::string& pattern,
                                      const std::vector<SpecialToken>& specials);
  // A model folder: tokenizer.json, else vocab.json + merges.txt, else encoder.json + vocab.bpe,
  // else tiktoken.model (its special tokens from tokenizer_config.json's added_tokens_decoder,
  // the rest of the 256 reserved ids after the vocabulary named <|reserved_token_ID|>, and the
  // split pattern from tokenizer_config.json's "pat_str", else Kimi's for the Kimi tokenizer).
  // The eos_token of tokenizer_config.json, when present, names the EOS token.
  static Tokenizer from_dir(const std::string& dir);
  // From parts in memory (a trainer's output). `origin` names the source in error messages.
  static Tokenizer from_vocab(const BpeVocab& vocab, const std::string& origin = "in-memory vocabulary");

  // Writes a tokenizer.json that Hugging Face tokenizers / PreTrainedTokenizerFast load as the same
  // tokenizer (BPE model, ByteLevel pre-tokenizer and decoder, specials as added_tokens).
  void save_hf_tokenizer_json(const std::string& path) const;

  // Special tokens in the text become their ids (tiktoken's allowed_special="all"); at one position
  // the longest special wins.
  std::vector<int32_t> encode(std::string_view text) const;
  // Special tokens' text is encoded as ordinary text.
  std::vector<int32_t> encode_ordinary(std::string_view text) const;
  // Appending forms, for callers that encode many documents into one buffer. With a `limit`, they
  // stop once `out` holds more than `limit` ids (the rest of the text is not encoded): a caller
  // that only needs to know a text is too long finds out without encoding all of it.
  static constexpr size_t kNoLimit = size_t(-1);
  void encode_into(std::string_view text, std::vector<int32_t>& out, size_t limit = kNoLimit) const;
  void encode_ordinary_into(std::string_view text, std::vector<int32_t>& out, size_t limit = kNoLimit) const;

  // The raw bytes of the tokens, concatenated: not necessarily valid UTF-8 (a multi-byte
  // character can be split across tokens). Throws k3::Error on an id that names no token.
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string token_bytes(int32_t id) const;

  // One more than the largest id (ids without a token, if any, are holes).
  int32_t vocab_size() const;
  std::optional<int32_t> special_id(std::string_view text) const;
  const std::vector<SpecialToken>& specials() const;
  // The EOS token: the one named by the loader (tokenizer_config.json's eos_token, BpeVocab::eos),
  // else <|endoftext|>, else the only special token if there is exactly one; nullopt otherwise.
  std::optional<int32_t> eos_id() const;

  // The model as raw bytes (inverse of from_vocab).
  BpeVocab to_vocab() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Turns generated ids back into printable text as they come: push() returns the bytes that are
// ready, holding back the start of a UTF-8 character that the next token may complete; flush()
// returns what is left. The concatenated outputs equal tok.decode(all ids). Keeps a reference to
// the tokenizer.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer* tok_;
  std::string pending_;
};

}  // namespace k3
