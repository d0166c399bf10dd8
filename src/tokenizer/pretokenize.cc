#include "tokenizer/pretokenize.h"

#include <unicode/uchar.h>

#include <array>
#include <memory>

namespace k3::tok {

namespace {

CharClass icu_class(uint32_t cp) {
  // White_Space first: tiktoken's \s is Rust regex's Unicode White_Space (u_isUWhiteSpace), not
  // ICU's u_isspace (which differs, e.g. on U+200B and U+180E) nor Python's str.isspace.
  if (u_isUWhiteSpace(UChar32(cp))) return CharClass::kSpace;
  switch (u_charType(UChar32(cp))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CharClass::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CharClass::kNumber;
    default:
      return CharClass::kOther;
  }
}

// Classes of all 65,536 BMP code points, computed once (64 KiB).
const uint8_t* bmp_table() {
  static const std::unique_ptr<uint8_t[]> table = [] {
    auto t = std::make_unique<uint8_t[]>(0x10000);
    for (uint32_t cp = 0; cp < 0x10000; ++cp) t[cp] = uint8_t(icu_class(cp));
    return t;
  }();
  return table.get();
}

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Allowed range of the second byte of a sequence led by b (Unicode Table 3-7); {0, 0} if b cannot
// lead a multi-byte sequence. *len gets the full sequence length.
std::pair<unsigned char, unsigned char> second_byte_range(unsigned char b, size_t* len) {
  if (b >= 0xC2 && b <= 0xDF) return *len = 2, std::pair<unsigned char, unsigned char>{0x80, 0xBF};
  if (b == 0xE0) return *len = 3, std::pair<unsigned char, unsigned char>{0xA0, 0xBF};
  if (b == 0xED) return *len = 3, std::pair<unsigned char, unsigned char>{0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return *len = 3, std::pair<unsigned char, unsigned char>{0x80, 0xBF};
  if (b == 0xF0) return *len = 4, std::pair<unsigned char, unsigned char>{0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return *len = 4, std::pair<unsigned char, unsigned char>{0x80, 0xBF};
  if (b == 0xF4) return *len = 4, std::pair<unsigned char, unsigned char>{0x80, 0x8F};
  return *len = 0, std::pair<unsigned char, unsigned char>{0, 0};
}

}  // namespace

CharClass char_class(uint32_t code_point) {
  if (code_point < 0x10000) return CharClass(bmp_table()[code_point]);
  return icu_class(code_point);
}

size_t utf8_sequence_at(std::string_view s, size_t pos, uint32_t* code_point) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  const size_t avail = s.size() - pos;
  if (p[0] < 0x80) return *code_point = p[0], 1;
  size_t len = 0;
  const auto [lo, hi] = second_byte_range(p[0], &len);
  if (len == 0 || avail < len || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i)
    if (!is_continuation(p[i])) return 0;
  uint32_t cp = p[0] & (0xFF >> (len + 1));
  for (size_t i = 1; i < len; ++i) cp = (cp << 6) | (p[i] & 0x3F);
  *code_point = cp;
  return len;
}

size_t utf8_incomplete_tail(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  // A lead byte at most 3 bytes from the end, followed only by continuation bytes.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char b = p[n - back];
    if (is_continuation(b)) continue;
    size_t len = 0;
    const auto [lo, hi] = second_byte_range(b, &len);
    if (len <= back) return 0;                                    // complete, or not a lead byte
    if (back >= 2 && (p[n - back + 1] < lo || p[n - back + 1] > hi)) return 0;  // already invalid
    return back;
  }
  return 0;
}

Gpt2Splitter::Gpt2Splitter(std::string_view text) : text_(text), bmp_(bmp_table()) {}

CharClass Gpt2Splitter::class_at(size_t pos, size_t* len) const {
  const auto b = static_cast<unsigned char>(text_[pos]);
  if (b < 0x80) {
    *len = 1;
    return CharClass(bmp_[b]);
  }
  uint32_t cp = 0;
  *len = utf8_sequence_at(text_, pos, &cp);
  if (*len == 0) {  // a byte outside any valid sequence: one "other" pseudo code point
    *len = 1;
    return CharClass::kOther;
  }
  return cp < 0x10000 ? CharClass(bmp_[cp]) : icu_class(cp);
}

size_t Gpt2Splitter::run_end(size_t pos, CharClass cls) const {
  size_t len = 0;
  while (pos < text_.size() && class_at(pos, &len) == cls) pos += len;
  return pos;
}

std::optional<std::string_view> Gpt2Splitter::next() {
  const size_t n = text_.size();
  const size_t start = pos_;
  if (start >= n) return std::nullopt;
  auto take = [&](size_t end) {
    pos_ = end;
    return text_.substr(start, end - start);
  };
  const char c = text_[start];

  // 's|'t|'re|'ve|'m|'ll|'d  (lowercase only)
  if (c == '\'' && start + 1 < n) {
    const char c1 = text_[start + 1];
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return take(start + 2);
    if (start + 2 < n) {
      const char c2 = text_[start + 2];
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        return take(start + 3);
    }
  }

  size_t len = 0;
  const CharClass cls = class_at(start, &len);
  // " ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+": the optional prefix is U+0020 only.
  if (c == ' ' && start + 1 < n) {
    size_t len1 = 0;
    const CharClass cls1 = class_at(start + 1, &len1);
    if (cls1 != CharClass::kSpace) return take(run_end(start + 1 + len1, cls1));
  }
  if (cls != CharClass::kSpace) return take(run_end(start + len, cls));

  // "\s+(?!\S)|\s+": a whitespace run at the end of the text is taken whole; followed by a
  // non-space it gives up its last character (which then prefixes the next piece or, if it is
  // not U+0020, becomes a piece of its own through \s+); a lone one falls to \s+.
  size_t last = start;
  size_t end = start;
  while (end < n && class_at(end, &len) == CharClass::kSpace) {
    last = end;
    end += len;
  }
  if (end == n || last == start) return take(end);
  return take(last);
}

std::vector<std::string_view> split_gpt2(std::string_view text) {
  std::vector<std::string_view> pieces;
  Gpt2Splitter splitter(text);
  while (auto piece = splitter.next()) pieces.push_back(*piece);
  return pieces;
}

}  // namespace k3::tok
