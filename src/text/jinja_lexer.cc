// The Jinja engine's lexer: template text into tokens (text runs, tag delimiters, names,
// literals, operators). Jinja's whitespace rules under transformers' settings live here.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "text/jinja_internal.h"

namespace k3::serve::jinja {

// ---------------------------------------------------------------------------------------------
// Lexer. The rules are Jinja's under transformers' settings (trim_blocks, lstrip_blocks):
//  - "{%-", "{{-", "{#-" remove all whitespace before the tag; "-%}", "-}}", "-#}" all after it;
//  - trim_blocks: a block tag or comment ("%}", "#}") eats the one newline right after it;
//  - lstrip_blocks: spaces and tabs between a line's start and a block tag or comment go (not
//    before "{{"); "{%+" and "+%}" turn both off for that tag.

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_name_start(char c) { return std::isalpha(uint8_t(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(uint8_t(c)) || c == '_'; }

const char* kOps3[] = {"//", "**", "==", "!=", ">=", "<="};
const char kOps1[] = "+-*/%~<>=()[]{}.,:|;";

class Lexer {
 public:
  explicit Lexer(const Source& src) : src_(src), s_(src.text) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < s_.size()) {
      size_t start = find_tag(pos);
      if (start == std::string::npos) {
        push(Tok::Text, s_.substr(pos), pos);
        break;
      }
      std::string text = s_.substr(pos, start - pos);
      const char kind = s_[start + 1];
      size_t p = start + 2;
      const char sign = p < s_.size() && (s_[p] == '-' || s_[p] == '+') ? s_[p] : 0;
      if (sign) ++p;
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (sign != '+' && kind != '{') {
        size_t l = text.rfind('\n');
        l = l == std::string::npos ? 0 : l + 1;
        if ((l > 0 || line_starting) && l < text.size() &&
            std::all_of(text.begin() + std::ptrdiff_t(l), text.end(), is_space))
          text.resize(l);
      }
      if (!text.empty()) push(Tok::Text, std::move(text), pos);
      pos = kind == '#' ? comment(start, p) : tag(kind, start, p);
      line_starting = s_[pos - 1] == '\n';
    }
    push(Tok::End, "", s_.size());
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t pos) const {
    for (size_t i = s_.find('{', pos); i != std::string::npos; i = s_.find('{', i + 1))
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    return std::string::npos;
  }

  void push(Tok t, std::string text, size_t pos) { out_.push_back(Token{t, std::move(text), pos}); }

  // After a closing "%}"/"#}" (at q, just past it) with sign '-', '+' or none: where text resumes.
  size_t after_end(size_t q, char sign, bool block) const {
    if (sign == '-') {
      while (q < s_.size() && is_space(s_[q])) ++q;
    } else if (!sign && block && q < s_.size() && s_[q] == '\n') {
      ++q;  // trim_blocks
    }
    return q;
  }

  size_t comment(size_t start, size_t p) {
    size_t e = s_.find("#}", p);
    if (e == std::string::npos) src_.fail(Kind::Syntax, start, "unterminated comment: '{#' has no closing '#}'");
    char sign = e > p && (s_[e - 1] == '-' || s_[e - 1] == '+') ? s_[e - 1] : 0;
    return after_end(e + 2, sign, true);
  }

  size_t tag(char kind, size_t start, size_t p) {
    const bool block = kind == '%';
    const char* close = block ? "%}" : "}}";
    push(block ? Tok::BlockBegin : Tok::VarBegin, "", start);
    std::vector<char> open;  // brackets: "}}" inside {...} is not the end of the tag
    for (;;) {
      while (p < s_.size() && is_space(s_[p])) ++p;
      if (p >= s_.size())
        src_.fail(Kind::Syntax, start,
                  std::string("unterminated tag: '") + (block ? "{%" : "{{") + "' has no closing '" + close + "'");
      if (open.empty()) {
        size_t q = p;
        char sign = 0;
        if (s_[q] == '-' || (block && s_[q] == '+')) sign = s_[q++];
        if (s_.compare(q, 2, close) == 0) {
          push(block ? Tok::BlockEnd : Tok::VarEnd, "", p);
          return after_end(q + 2, sign, block);
        }
      }
      p = token(p, open);
    }
  }

  size_t token(size_t p, std::vector<char>& open) {
    const char c = s_[p];
    if (is_name_start(c)) {
      size_t e = p;
      while (e < s_.size() && is_name_char(s_[e])) ++e;
      push(Tok::Name, s_.substr(p, e - p), p);
      return e;
    }
    if (std::isdigit(uint8_t(c))) return number(p);
    if (c == '\'' || c == '"') return string(p);
    for (const char* op : kOps3)
      if (s_.compare(p, 2, op) == 0) {
        push(Tok::Op, op, p);
        return p + 2;
      }
    if (std::strchr(kOps1, c)) {
      if (c == '(' || c == '[' || c == '{') open.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      if (c == ')' || c == ']' || c == '}') {
        if (open.empty() || open.back() != c)
          src_.fail(Kind::Syntax, p,
                    std::string("unexpected '") + c + "'" +
                        (open.empty() ? "" : std::string(", expected '") + open.back() + "'"));
        open.pop_back();
      }
      push(Tok::Op, std::string(1, c), p);
      return p + 1;
    }
    src_.fail(Kind::Syntax, p, "unexpected character '" + std::string(code_points(s_.substr(p, 4))[0]) + "'");
  }

  size_t digits(size_t p) const {
    auto digit = [&](size_t i) { return i < s_.size() && std::isdigit(uint8_t(s_[i])); };
    while (digit(p) || (p < s_.size() && s_[p] == '_' && digit(p + 1))) ++p;  // 1_000 is 1000
    return p;
  }

  size_t number(size_t p) {
    size_t e = digits(p);
    bool is_float = false;
    // "x.0.1" is x[0][1] in Jinja, not x[0.1]: no fraction right after a '.'.
    const bool after_dot = p > 0 && s_[p - 1] == '.';
    if (!after_dot && e + 1 < s_.size() && s_[e] == '.' && std::isdigit(uint8_t(s_[e + 1]))) {
      e = digits(e + 1);
      is_float = true;
    }
    if (!after_dot && e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t q = e + 1;
      if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
      if (q < s_.size() && std::isdigit(uint8_t(s_[q]))) {
        e = digits(q);
        is_float = true;
      }
    }
    std::string t = s_.substr(p, e - p);
    t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
    Token tok{is_float ? Tok::Float : Tok::Int, t, p};
    if (is_float) {
      tok.f = std::strtod(t.c_str(), nullptr);
    } else {
      auto r = std::from_chars(t.data(), t.data() + t.size(), tok.i);
      if (r.ec != std::errc()) src_.fail(Kind::Syntax, p, "integer literal " + t + " is too large");
    }
    out_.push_back(tok);
    return e;
  }

  // A quoted string with Python's escapes (Jinja decodes them with "unicode-escape").
  size_t string(size_t p) {
    const char q = s_[p];
    std::string v;
    size_t i = p + 1;
    auto hex = [&](size_t n) {
      uint32_t x = 0;
      for (size_t k = 0; k < n; ++k) {
        if (i + k >= s_.size() || !std::isxdigit(uint8_t(s_[i + k])))
          src_.fail(Kind::Syntax, i - 2, "bad \\x, \\u or \\U escape in a string");
        x = x * 16 + uint32_t(std::isdigit(uint8_t(s_[i + k])) ? s_[i + k] - '0' : std::tolower(s_[i + k]) - 'a' + 10);
      }
      i += n;
      return x;
    };
    for (;;) {
      if (i >= s_.size()) src_.fail(Kind::Syntax, p, "unterminated string literal");
      char c = s_[i++];
      if (c == q) break;
      if (c != '\\') {
        v += c;
        continue;
      }
      if (i >= s_.size()) src_.fail(Kind::Syntax, p, "unterminated string literal");
      char e = s_[i++];
      auto esc = std::find_if(std::begin(kEscapes), std::end(kEscapes), [&](auto& x) { return x.second == e; });
      if (esc != std::end(kEscapes)) {
        v += esc->first;
        continue;
      }
      switch (e) {
        case '\n': break;  // a backslash before a newline joins the lines
        case '\'': v += '\''; break;
        case 'a': v += '\a'; break;
        case 'v': v += '\v'; break;
        case 'x': append_utf8(v, hex(2)); break;
        case 'u': append_utf8(v, hex(4)); break;
        case 'U': {
          uint32_t x = hex(8);
          if (x > 0x10FFFF) src_.fail(Kind::Syntax, i - 10, "\\U escape beyond U+10FFFF");
          append_utf8(v, x);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {  // up to three octal digits
            uint32_t x = uint32_t(e - '0');
            for (int k = 0; k < 2 && i < s_.size() && s_[i] >= '0' && s_[i] <= '7'; ++k)
              x = x * 8 + uint32_t(s_[i++] - '0');
            append_utf8(v, x);
          } else {  // Python keeps an unknown escape as written
            v += '\\';
            v += e;
          }
      }
    }
    push(Tok::String, std::move(v), p);
    return i;
  }

  const Source& src_;
  const std::string& s_;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> lex(const Source& src) { return Lexer(src).run(); }

}  // namespace k3::serve::jinja
