// Text pipelines other than GPT-2's: the normalizers and pre-tokenizers of Hugging Face's
// tokenizer.json (Split with any regex, Digits, ByteLevel, Whitespace, NFC/NFKC/NFD/NFKD,
// Lowercase, and Sequences of them) and tiktoken's split patterns (Kimi's, cl100k-style). Regexes
// run on ICU's engine, which reads the patterns these families ship as their own engines do
// (Oniguruma for tokenizers, Rust's regex for tiktoken), class intersection `&&` included; `\s`
// and `\S` are rewritten to the Unicode White_Space property, as those engines define them.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace k3::tok {

// A compiled regex over UTF-8. Every const method may be called from many threads at once (each
// thread matches with its own clone of the compiled pattern).
class Regex {
 public:
  explicit Regex(std::string pattern);  // k3::Error naming the pattern and where it fails to parse
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // The [begin, end) byte spans of the non-empty, non-overlapping matches in text, leftmost first,
  // appended to `spans`. A byte that is not part of well-formed UTF-8 reads as U+FFFD.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& spans) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Compiled;
  std::string pattern_;
  std::unique_ptr<Compiled> compiled_;
  uint64_t uid_;
};

// What becomes of the matches of a Split (tokenizers' SplitDelimiterBehavior).
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// A normalizer and a pre-tokenizer: text in, pieces out (each piece then goes to BPE on its own).
class TextPipeline {
 public:
  using Json = nlohmann::json;
  // From tokenizer.json's "normalizer" and "pre_tokenizer" (either may be null). Null result: the
  // pipeline is GPT-2's ByteLevel split alone, which the caller runs with its fast matcher.
  // Unsupported steps are a k3::Error naming the step and `where`.
  static std::shared_ptr<const TextPipeline> from_hf(const Json& normalizer, const Json& pre_tokenizer,
                                                     const std::string& where);
  // A tiktoken split pattern: the text's matches are the pieces (what falls between matches is a
  // piece too).
  static std::shared_ptr<const TextPipeline> from_pattern(const std::string& pattern, const std::string& where);

  // Normalizes text (into `storage` when a normalizer changes it) and appends the pieces, views
  // into `text` or `storage`, in order.
  void split(std::string_view text, std::string& storage, std::vector<std::string_view>& pieces) const;
  bool normalizes() const { return !norms_.empty(); }

  // The tokenizer.json forms, for saving.
  Json normalizer_json() const { return normalizer_json_; }
  Json pre_tokenizer_json() const { return pre_tokenizer_json_; }

 private:
  enum class Norm { NFC, NFD, NFKC, NFKD, Lowercase };
  struct Step {
    enum class Kind { Split, Digits, Gpt2ByteLevel } kind = Kind::Split;
    std::shared_ptr<const Regex> regex;  // Split with a regex
    std::string literal;                 // Split with a string
    SplitBehavior behavior = SplitBehavior::Isolated;
    bool invert = false;
    bool individual_digits = false;
  };
  void add_pre(const Json& j, const std::string& where);
  void add_norm(const Json& j, const std::string& where);
  void apply(const Step& s, std::string_view text, std::vector<std::pair<size_t, size_t>>& spans) const;

  std::vector<Norm> norms_;
  std::vector<Step> steps_;
  Json normalizer_json_, pre_tokenizer_json_;
};

// tokenization_kimi.py's split pattern (Kimi Linear, Kimi K2 and K3 ship a tiktoken.model with it).
extern const char* const kKimiPattern;

}  // namespace k3::tok
