// GPT-2 pre-tokenizer: splits text into the pieces that BPE then encodes one by one, exactly as
// tiktoken's regex  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// does, written as a hand-made matcher over code points (README.md in this folder says why and
// how, including the rule for bytes that are not valid UTF-8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace k3::tok {

// The only character distinctions the GPT-2 pattern makes. kLetter = \p{L} (Lu Ll Lt Lm Lo),
// kNumber = \p{N} (Nd Nl No), kSpace = \s (the Unicode White_Space property), kOther = the rest,
// including each byte that is not part of a valid UTF-8 sequence.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

CharClass char_class(uint32_t code_point);

// Length (1-4) of the well-formed UTF-8 sequence that starts at s[pos] (Unicode Table 3-7:
// no overlongs, no surrogates, nothing above U+10FFFF), or 0 if none does. *code_point gets its
// value when the result is not 0.
size_t utf8_sequence_at(std::string_view s, size_t pos, uint32_t* code_point);

// Number of bytes at the end of s that begin a well-formed UTF-8 sequence but do not finish it
// (0-3): what a streaming printer should hold back until the next bytes arrive.
size_t utf8_incomplete_tail(std::string_view s);

// Iterates over the pieces of one text (no special-token handling: callers cut those out first,
// as tiktoken does, so the regex's look-ahead stops at a special token). Pieces are views into
// the text and cover it exactly, in order.
class Gpt2Splitter {
 public:
  explicit Gpt2Splitter(std::string_view text);
  std::optional<std::string_view> next();

 private:
  CharClass class_at(size_t pos, size_t* len) const;
  size_t run_end(size_t pos, CharClass cls) const;  // end of the maximal run of cls from pos

  std::string_view text_;
  size_t pos_ = 0;
  const uint8_t* bmp_;  // CharClass of every BMP code point
};

std::vector<std::string_view> split_gpt2(std::string_view text);

}  // namespace k3::tok
