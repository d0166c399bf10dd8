// The Jinja subset of chat_template.h in three stages: a lexer (Jinja's whitespace rules live
// here), a recursive-descent parser to a small syntax tree (syntax errors, with positions), and a
// tree-walking renderer over JSON values with Python's semantics (str(), ==, //, slicing, ...),
// bounded in steps, output and depth so that no template or conversation can hang or crash it.
#include "infer/serve/chat_template.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string_view>
#include <vector>

namespace k3::serve {

namespace {
std::string where(int line, int column) {
  if (line <= 0) return "";
  return "line " + std::to_string(line) + ", column " + std::to_string(column) + ": ";
}
}  // namespace

TemplateError::TemplateError(Kind kind, const std::string& message, int line, int column)
    : Error("chat template", where(line, column) + message), kind_(kind), message_(message), line_(line),
      column_(column) {}

namespace {

using J = TemplateJson;
using Kind = TemplateError::Kind;

constexpr int kMaxNesting = 200;             // parser recursion (expressions and blocks)
constexpr int kMaxCallDepth = 64;            // macro calls inside macro calls
constexpr int kMaxDataDepth = 512;           // nesting of values printed or compared
constexpr size_t kMaxOutput = 16u << 20;     // bytes a render may produce
constexpr uint64_t kMaxSteps = 5'000'000;    // expressions, statements and loop passes per render (~1 s)
constexpr int64_t kMaxRange = 100'000;       // items range() or list repetition may make

// A failure found by a helper that does not know where in the template it is; eval() adds the
// position of the expression being evaluated.
struct Fail {
  std::string msg;
};

// ---------------------------------------------------------------------------------------------
// Source text and positions

struct Source {
  std::string text;
  std::pair<int, int> line_col(size_t pos) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < pos && i < text.size(); ++i) {
      if (text[i] == '\n') line++, col = 1;
      else if ((uint8_t(text[i]) & 0xC0) != 0x80) col++;  // columns count code points
    }
    return {line, col};
  }
  [[noreturn]] void fail(Kind kind, size_t pos, const std::string& msg) const {
    auto [l, c] = line_col(pos);
    throw TemplateError(kind, msg, l, c);
  }
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_name_start(char c) { return std::isalpha(uint8_t(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(uint8_t(c)) || c == '_'; }

// ---------------------------------------------------------------------------------------------
// UTF-8: Python strings index by code point, so k3 does too.

// The code points of s as byte ranges (an invalid byte counts as one).
std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint8_t c = uint8_t(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    for (size_t k = 1; k < n; ++k)
      if ((uint8_t(s[i + k]) & 0xC0) != 0x80) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

uint32_t decode(std::string_view cp) {
  uint8_t c = uint8_t(cp[0]);
  if (cp.size() == 1) return c;
  uint32_t v = c & (0xFF >> (cp.size() + 1));
  for (size_t k = 1; k < cp.size(); ++k) v = (v << 6) | (uint8_t(cp[k]) & 0x3F);
  return v;
}

void append_utf8(std::string& out, uint32_t v) {
  if (v < 0x80) {
    out += char(v);
  } else if (v < 0x800) {
    out += char(0xC0 | (v >> 6));
    out += char(0x80 | (v & 0x3F));
  } else if (v < 0x10000) {
    out += char(0xE0 | (v >> 12));
    out += char(0x80 | ((v >> 6) & 0x3F));
    out += char(0x80 | (v & 0x3F));
  } else {
    out += char(0xF0 | (v >> 18));
    out += char(0x80 | ((v >> 12) & 0x3F));
    out += char(0x80 | ((v >> 6) & 0x3F));
    out += char(0x80 | (v & 0x3F));
  }
}

// Python's str.isspace() set.
bool is_py_space(uint32_t v) {
  return (v >= 0x09 && v <= 0x0D) || (v >= 0x1C && v <= 0x20) || v == 0x85 || v == 0xA0 || v == 0x1680 ||
         (v >= 0x2000 && v <= 0x200A) || v == 0x2028 || v == 0x2029 || v == 0x202F || v == 0x205F || v == 0x3000;
}

// str.strip / lstrip / rstrip: chars == nullptr strips whitespace, else any code point of *chars.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  auto cps = code_points(s);
  std::vector<std::string_view> set;
  if (chars) set = code_points(*chars);
  auto strip = [&](std::string_view cp) {
    return chars ? std::find(set.begin(), set.end(), cp) != set.end() : is_py_space(decode(cp));
  };
  size_t b = 0, e = cps.size();
  while (left && b < e && strip(cps[b])) ++b;
  while (right && e > b && strip(cps[e - 1])) --e;
  if (b == e) return {};
  return std::string(cps[b].data(), size_t(cps[e - 1].data() + cps[e - 1].size() - cps[b].data()));
}

std::string ascii_map(std::string s, int (*f)(int)) {
  for (char& c : s)
    if (uint8_t(c) < 0x80) c = char(f(c));
  return s;
}

// str.title(): a letter after a non-letter starts a word.
std::string ascii_title(std::string s) {
  bool prev_letter = false;
  for (char& c : s) {
    bool letter = std::isalpha(uint8_t(c)) != 0 && uint8_t(c) < 0x80;
    if (letter) c = char(prev_letter ? std::tolower(c) : std::toupper(c));
    prev_letter = letter || uint8_t(c) >= 0x80;
  }
  return s;
}

std::string ascii_capitalize(std::string s) {
  s = ascii_map(std::move(s), [](int c) { return std::tolower(c); });
  if (!s.empty() && uint8_t(s[0]) < 0x80) s[0] = char(std::toupper(s[0]));
  return s;
}

std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) {  // Python inserts `to` between every code point (and at both ends)
    std::string out;
    int64_t n = 0;
    for (auto cp : code_points(s)) {
      if (count < 0 || n++ < count) out += to;
      out += cp;
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  std::string out;
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// str.split(sep=None, maxsplit=-1).
J py_split(const std::string& s, const std::string* sep, int64_t maxsplit) {
  J out = J::array();
  if (sep) {
    if (sep->empty()) throw Fail{"split(): empty separator"};
    size_t pos = 0;
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      size_t hit = s.find(*sep, pos);
      if (hit == std::string::npos) break;
      out.push_back(s.substr(pos, hit - pos));
      pos = hit + sep->size();
    }
    out.push_back(s.substr(pos));
    return out;
  }
  auto cps = code_points(s);
  size_t i = 0;
  int64_t n = 0;
  while (true) {
    while (i < cps.size() && is_py_space(decode(cps[i]))) ++i;
    if (i == cps.size()) break;
    size_t b = i;
    if (maxsplit >= 0 && n == maxsplit) {  // the rest, trailing whitespace and all, is one piece
      out.push_back(std::string(cps[b].data(), size_t(s.data() + s.size() - cps[b].data())));
      break;
    }
    while (i < cps.size() && !is_py_space(decode(cps[i]))) ++i;
    out.push_back(std::string(cps[b].data(), size_t(cps[i - 1].data() + cps[i - 1].size() - cps[b].data())));
    ++n;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Python's text forms of values: str(), repr(), json.dumps().

// repr(float): the shortest digits that round-trip, fixed notation for exponents in [-4, 16).
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // like "-1.2345e+02"
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t e = sci.find('e');
  int exp = std::stoi(sci.substr(e + 1));
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += exp < 0 ? "e-" : "e+";
    std::string es = std::to_string(std::abs(exp));
    if (es.size() < 2) es = "0" + es;
    return out + es;
  }
  if (exp < 0) return out + "0." + std::string(size_t(-exp - 1), '0') + digits;
  if (digits.size() <= size_t(exp) + 1) return out + digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
  return out + digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
}

std::string py_repr_str(const std::string& s) {
  bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  char q = has_sq && !has_dq ? '"' : '\'';
  std::string out(1, q);
  for (auto cp : code_points(s)) {
    uint32_t v = decode(cp);
    char hex[8];
    if (v == '\\') out += "\\\\";
    else if (v == uint32_t(q)) out += std::string("\\") + q;
    else if (v == '\n') out += "\\n";
    else if (v == '\r') out += "\\r";
    else if (v == '\t') out += "\\t";
    else if (v < 0x20 || (v >= 0x7F && v < 0xA0)) {
      std::snprintf(hex, sizeof hex, "\\x%02x", v);
      out += hex;
    } else {
      out += cp;
    }
  }
  return out + q;
}

void check_depth(int depth) {
  if (depth > kMaxDataDepth) throw Fail{"a value nests deeper than " + std::to_string(kMaxDataDepth) + " levels"};
}

std::string py_repr(const J& j, int depth = 0);

// str(value) as Python prints it ({{ x }}, ~, |string).
std::string py_str(const J& j, int depth = 0) {
  check_depth(depth);
  switch (j.type()) {
    case J::value_t::string: return j.get_ref<const std::string&>();
    case J::value_t::null: return "None";
    case J::value_t::boolean: return j.get<bool>() ? "True" : "False";
    case J::value_t::number_integer: return std::to_string(j.get<int64_t>());
    case J::value_t::number_unsigned: return std::to_string(j.get<uint64_t>());
    case J::value_t::number_float: return py_float(j.get<double>());
    case J::value_t::array: {
      std::string s = "[";
      for (size_t i = 0; i < j.size(); ++i) s += (i ? ", " : "") + py_repr(j[i], depth + 1);
      return s + "]";
    }
    case J::value_t::object: {
      std::string s = "{";
      bool first = true;
      for (auto it = j.begin(); it != j.end(); ++it) {
        s += (first ? "" : ", ") + py_repr_str(it.key()) + ": " + py_repr(it.value(), depth + 1);
        first = false;
      }
      return s + "}";
    }
    default: return "";
  }
}

std::string py_repr(const J& j, int depth) {
  return j.is_string() ? py_repr_str(j.get_ref<const std::string&>()) : py_str(j, depth);
}

struct DumpOptions {
  int indent = -1;  // -1: one line
  std::string item_sep = ", ", key_sep = ": ";
  bool ensure_ascii = false, sort_keys = false;
};

// Backslash escapes shared by JSON strings (written) and Python string literals (read): the
// character and the letter after the backslash.
constexpr std::pair<char, char> kEscapes[] = {{'"', '"'},  {'\\', '\\'}, {'\n', 'n'}, {'\r', 'r'},
                                              {'\t', 't'}, {'\b', 'b'},   {'\f', 'f'}};

void dump_str(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (auto cp : code_points(s)) {
    uint32_t v = decode(cp);
    char hex[16];
    auto esc = std::find_if(std::begin(kEscapes), std::end(kEscapes), [&](auto& e) { return uint32_t(e.first) == v; });
    if (esc != std::end(kEscapes)) {
      out += '\\';
      out += esc->second;
      continue;
    }
    if (v < 0x20 || (ensure_ascii && v >= 0x7F)) {
      if (v >= 0x10000) {  // a surrogate pair, as json.dumps writes it
        v -= 0x10000;
        std::snprintf(hex, sizeof hex, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        std::snprintf(hex, sizeof hex, "\\u%04x", v);
      }
      out += hex;
    } else {
      out += cp;
    }
  }
  out += '"';
}

// json.dumps(value, ensure_ascii, indent, separators, sort_keys).
void dump_json(std::string& out, const J& j, const DumpOptions& o, int depth) {
  check_depth(depth);
  auto newline = [&](int level) {
    if (o.indent < 0) return;
    out += '\n';
    out.append(size_t(o.indent) * size_t(level), ' ');
  };
  switch (j.type()) {
    case J::value_t::null: out += "null"; return;
    case J::value_t::boolean: out += j.get<bool>() ? "true" : "false"; return;
    case J::value_t::number_float: {
      double d = j.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : py_float(d);
      return;
    }
    case J::value_t::number_integer:
    case J::value_t::number_unsigned: out += py_str(j); return;
    case J::value_t::string: dump_str(out, j.get_ref<const std::string&>(), o.ensure_ascii); return;
    case J::value_t::array: {
      if (j.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < j.size(); ++i) {
        if (i) out += o.item_sep;
        newline(depth + 1);
        dump_json(out, j[i], o, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case J::value_t::object: {
      if (j.empty()) {
        out += "{}";
        return;
      }
      std::vector<J::const_iterator> items;
      for (auto it = j.begin(); it != j.end(); ++it) items.push_back(it);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.key() < b.key(); });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_sep;
        newline(depth + 1);
        dump_str(out, items[i].key(), o.ensure_ascii);
        out += o.key_sep;
        dump_json(out, items[i].value(), o, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default: throw Fail{"tojson: this value cannot be written as JSON"};
  }
}

// ---------------------------------------------------------------------------------------------
// Lexer. The rules are Jinja's under transformers' settings (trim_blocks, lstrip_blocks):
//  - "{%-", "{{-", "{#-" remove all whitespace before the tag; "-%}", "-}}", "-#}" all after it;
//  - trim_blocks: a block tag or comment ("%}", "#}") eats the one newline right after it;
//  - lstrip_blocks: spaces and tabs between a line's start and a block tag or comment go (not
//    before "{{"); "{%+" and "+%}" turn both off for that tag.

enum class Tok : uint8_t { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok type;
  std::string text;  // Text: the text; Name, Op: the name or operator; String: the decoded value
  size_t pos;
  int64_t i = 0;
  double f = 0;
};

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

// ---------------------------------------------------------------------------------------------
// Syntax tree

enum class EK : uint8_t {
  Literal, Name, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Binary, Compare, Cond, List, Dict
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Arg {
  std::string name;  // "" for a positional argument
  ExprPtr value;
};

struct Expr {
  EK kind;
  size_t pos;
  J value;                   // Literal
  std::string name;          // Name; Attr: the attribute; Filter, Test: which; Binary: the operator
  std::vector<ExprPtr> kids; // operands; Attr/Item/Slice/Call/Filter/Test: kids[0] is the object.
                             // Slice: object, start, stop, step (null when left out). Cond: then, if, else.
                             // Dict: key, value, key, value, ...
  std::vector<Arg> args;     // Call, Filter, Test
  std::vector<std::string> ops;  // Compare: the operators between kids
  bool negate = false;       // Test: "is not"
};

enum class NK : uint8_t { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Group };

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  NK kind;
  size_t pos;
  std::string text;                // Text
  std::vector<ExprPtr> exprs;      // Output: value; If: one condition per branch; For: iterable, filter (or null);
                                   // Set: value; Macro: one default per parameter (or null)
  std::vector<Body> bodies;        // If: one per condition, then else; For: body, else; SetBlock, Macro, Group: body
  std::vector<std::string> names;  // For: loop targets; Set: variable (and attribute); SetBlock: variable;
                                   // Macro: its name, then the parameters
};

const std::set<std::string, std::less<>> kFilters = {
    "abs", "capitalize", "count", "d", "default", "first", "float", "int", "items", "join", "last", "length",
    "list", "lower", "map", "reject", "rejectattr", "replace", "reverse", "safe", "select", "selectattr",
    "string", "title", "tojson", "trim", "unique", "upper"};
const std::set<std::string, std::less<>> kTests = {
    "boolean", "defined", "divisibleby", "eq", "equalto", "even", "false", "float", "ge", "gt", "greaterthan",
    "in", "integer", "iterable", "le", "lessthan", "lower", "lt", "mapping", "ne", "none", "number", "odd",
    "sameas", "sequence", "string", "true", "undefined", "upper", "==", "!=", "<", "<=", ">", ">="};

// ---------------------------------------------------------------------------------------------
// Parser: Jinja's grammar and operator precedence, lowest first:
//   a if c else b;  or;  and;  not;  == != < > <= >= in, not in;  + -;  ~;  * / // %;  **;
//   unary - +;  then postfix .attr [i] (args), and filters |f and tests "is t" bind tightest.

struct OpenBlock {
  std::string tag;  // "if", "for", ...
  size_t pos;
};

class Parser {
 public:
  Parser(const Source& src, std::vector<Token> toks) : src_(src), t_(std::move(toks)) {}

  Body parse() {
    std::string ended;
    Body b = body({}, nullptr, ended);
    return b;
  }

 private:
  // ---- token helpers
  const Token& cur() const { return t_[i_]; }
  const Token& next() { return t_[i_++]; }
  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == Tok::Name && cur().text == n; }
  bool eat_op(const char* op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool eat_name(const char* n) {
    if (!is_name(n)) return false;
    ++i_;
    return true;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Text: return "text";
      case Tok::VarBegin: return "'{{'";
      case Tok::VarEnd: return "'}}'";
      case Tok::BlockBegin: return "'{%'";
      case Tok::BlockEnd: return "'%}'";
      case Tok::Name: return "'" + t.text + "'";
      case Tok::String: return "a string";
      case Tok::Int:
      case Tok::Float: return "the number " + t.text;
      case Tok::Op: return "'" + t.text + "'";
      case Tok::End: return "the end of the template";
    }
    return "?";
  }
  [[noreturn]] void fail(const std::string& msg) const { src_.fail(Kind::Syntax, cur().pos, msg); }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    fail("expected " + wanted + ", found " + describe(cur()));
  }
  void expect_op(const char* op) {
    if (!eat_op(op)) unexpected(std::string("'") + op + "'");
  }
  std::string expect_name(const char* what) {
    if (cur().type != Tok::Name) unexpected(what);
    return next().text;
  }
  // Items separated by commas up to the closing `close` (a trailing comma allowed); item() parses one.
  template <class F>
  void comma_list(const char* close, F&& item) {
    for (bool first = true; !eat_op(close); first = false) {
      if (!first) {
        expect_op(",");
        if (eat_op(close)) break;
      }
      item();
    }
  }
  void expect_block_end(const char* after) {
    if (cur().type != Tok::BlockEnd) unexpected(std::string("'%}' after ") + after);
    ++i_;
  }
  struct Nest {
    Parser& p;
    explicit Nest(Parser& pp) : p(pp) {
      if (++p.depth_ > kMaxNesting) p.fail("the template nests deeper than " + std::to_string(kMaxNesting) + " levels");
    }
    ~Nest() { --p.depth_; }
  };

  // ---- statements

  // Nodes up to a "{% name" with name in `ends` (consumed; the rest of that tag is the caller's),
  // or the end of the template when `ends` is empty.
  Body body(const std::vector<std::string>& ends, const OpenBlock* open, std::string& ended) {
    Nest nest(*this);
    Body out;
    for (;;) {
      const Token& tk = cur();
      if (tk.type == Tok::End) {
        if (ends.empty()) return out;
        auto [l, c] = src_.line_col(open->pos);
        fail("unexpected end of template: the '{% " + open->tag + " %}' at line " + std::to_string(l) + ", column " +
             std::to_string(c) + " is never closed with '{% " + ends.back() + " %}'");
      }
      if (tk.type == Tok::Text) {
        auto n = std::make_unique<Node>(Node{NK::Text, tk.pos, tk.text, {}, {}, {}});
        out.push_back(std::move(n));
        ++i_;
      } else if (tk.type == Tok::VarBegin) {
        ++i_;
        auto n = std::make_unique<Node>(Node{NK::Output, tk.pos, "", {}, {}, {}});
        if (cur().type == Tok::VarEnd) fail("empty '{{ }}': expected an expression");
        n->exprs.push_back(expression());
        if (cur().type != Tok::VarEnd) unexpected("'}}'");
        ++i_;
        out.push_back(std::move(n));
      } else if (tk.type == Tok::BlockBegin) {
        ++i_;
        if (cur().type != Tok::Name) unexpected("a tag name such as 'if', 'for' or 'set'");
        const std::string name = cur().text;
        if (std::find(ends.begin(), ends.end(), name) != ends.end()) {
          ++i_;
          ended = name;
          return out;
        }
        out.push_back(statement(tk.pos, open, ends));
      } else {
        unexpected("text, '{{' or '{%'");
      }
    }
  }

  std::unique_ptr<Node> statement(size_t pos, const OpenBlock* open, const std::vector<std::string>& ends) {
    const std::string name = next().text;
    auto node = std::make_unique<Node>(Node{NK::Text, pos, "", {}, {}, {}});
    std::string ended;
    if (name == "if") {
      node->kind = NK::If;
      OpenBlock ob{"if", pos};
      node->exprs.push_back(expression());
      expect_block_end("the 'if' condition");
      node->bodies.push_back(body({"elif", "else", "endif"}, &ob, ended));
      while (ended == "elif") {
        node->exprs.push_back(expression());
        expect_block_end("the 'elif' condition");
        node->bodies.push_back(body({"elif", "else", "endif"}, &ob, ended));
      }
      if (ended == "else") {
        expect_block_end("'else'");
        node->bodies.push_back(body({"endif"}, &ob, ended));
      }
      expect_block_end("'endif'");
    } else if (name == "for") {
      node->kind = NK::For;
      OpenBlock ob{"for", pos};
      do node->names.push_back(expect_name("a loop variable name"));
      while (eat_op(","));
      if (!eat_name("in")) unexpected("'in'");
      node->exprs.push_back(or_expr());
      node->exprs.push_back(eat_name("if") ? expression() : nullptr);
      if (is_name("recursive")) fail("recursive loops are not supported");
      expect_block_end("the 'for' header");
      loops_++;
      node->bodies.push_back(body({"else", "endfor"}, &ob, ended));
      loops_--;
      if (ended == "else") {
        expect_block_end("'else'");
        node->bodies.push_back(body({"endfor"}, &ob, ended));
      }
      expect_block_end("'endfor'");
    } else if (name == "set") {
      node->names.push_back(expect_name("a variable name after 'set'"));
      if (eat_op(".")) node->names.push_back(expect_name("an attribute name"));
      if (eat_op("=")) {
        node->kind = NK::Set;
        node->exprs.push_back(expression());
        expect_block_end("the 'set' value");
      } else if (cur().type == Tok::BlockEnd && node->names.size() == 1) {
        ++i_;
        node->kind = NK::SetBlock;
        OpenBlock ob{"set", pos};
        node->bodies.push_back(body({"endset"}, &ob, ended));
        expect_block_end("'endset'");
      } else {
        unexpected("'=' after the 'set' target");
      }
    } else if (name == "macro") {
      node->kind = NK::Macro;
      OpenBlock ob{"macro", pos};
      node->names.push_back(expect_name("a macro name"));
      expect_op("(");
      comma_list(")", [&] {
        node->names.push_back(expect_name("a parameter name"));
        node->exprs.push_back(eat_op("=") ? expression() : nullptr);
      });
      expect_block_end("the macro's parameters");
      const int saved = std::exchange(loops_, 0);  // no break/continue across a macro's boundary
      node->bodies.push_back(body({"endmacro"}, &ob, ended));
      loops_ = saved;
      expect_block_end("'endmacro'");
    } else if (name == "break" || name == "continue") {
      if (loops_ == 0) src_.fail(Kind::Syntax, pos, "'{% " + name + " %}' outside a for loop");
      node->kind = name == "break" ? NK::Break : NK::Continue;
      expect_block_end(name == "break" ? "'break'" : "'continue'");
    } else if (name == "generation") {  // transformers' assistant-mask marker: renders as its body
      node->kind = NK::Group;
      OpenBlock ob{"generation", pos};
      expect_block_end("'generation'");
      node->bodies.push_back(body({"endgeneration"}, &ob, ended));
      expect_block_end("'endgeneration'");
    } else if (name == "raw" || name == "include" || name == "extends" || name == "block" || name == "import" ||
               name == "from" || name == "call" || name == "filter" || name == "with" || name == "autoescape" ||
               name == "do") {
      src_.fail(Kind::Syntax, pos, "'{% " + name + " %}' is not supported by k3's template renderer");
    } else if (name.rfind("end", 0) == 0 || name == "elif" || name == "else") {
      std::string msg = "unexpected '{% " + name + " %}'";
      if (open) {
        auto [l, c] = src_.line_col(open->pos);
        msg += ": the innermost open block is the '{% " + open->tag + " %}' at line " + std::to_string(l) +
               ", column " + std::to_string(c) + ", which ends with '{% " + ends.back() + " %}'";
      } else {
        msg += ": no block is open";
      }
      src_.fail(Kind::Syntax, pos, msg);
    } else {
      src_.fail(Kind::Syntax, pos, "unknown tag '" + name + "'");
    }
    return node;
  }

  // ---- expressions

  ExprPtr make(EK kind, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }
  ExprPtr unary(EK kind, size_t pos, ExprPtr a) {
    auto e = make(kind, pos);
    e->kids.push_back(std::move(a));
    return e;
  }
  ExprPtr binary(EK kind, size_t pos, std::string op, ExprPtr a, ExprPtr b) {
    auto e = make(kind, pos);
    e->name = std::move(op);
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }

  ExprPtr expression() {  // with "a if c else b"
    Nest nest(*this);
    ExprPtr e = or_expr();
    while (is_name("if")) {
      size_t pos = next().pos;
      auto c = make(EK::Cond, pos);
      c->kids.push_back(std::move(e));
      c->kids.push_back(or_expr());
      c->kids.push_back(eat_name("else") ? expression() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  // The left-associative binary operators, loosest first; a level's operands are the next level's,
  // except "and", whose operands are "not" expressions, and "**", whose are unary expressions.
  static constexpr size_t kLevels = 6;
  static constexpr std::array<std::array<const char*, 4>, kLevels> kBinaryOps = {{
      {"or"}, {"and"}, {"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}}};

  ExprPtr binary_level(size_t level) {
    auto operand = [&] {
      return level == 1 ? not_expr() : level + 1 == kLevels ? unary_expr(true) : binary_level(level + 1);
    };
    auto at_op = [&](const char* op) { return op && (is_name(op) || is_op(op)); };
    ExprPtr e = operand();
    for (;;) {
      if (std::none_of(kBinaryOps[level].begin(), kBinaryOps[level].end(), at_op)) return e;
      const Token& op = next();
      const EK kind = level == 0 ? EK::Or : level == 1 ? EK::And : EK::Binary;
      e = binary(kind, op.pos, op.text, std::move(e), operand());
    }
  }
  ExprPtr or_expr() { return binary_level(0); }

  ExprPtr not_expr() {
    if (is_name("not")) {
      Nest nest(*this);
      size_t pos = next().pos;
      return unary(EK::Not, pos, not_expr());
    }
    return compare();
  }

  ExprPtr compare() {
    size_t pos = cur().pos;
    ExprPtr first = binary_level(2);
    ExprPtr cmp;
    for (;;) {
      std::string op;
      if (cur().type == Tok::Op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" || cur().text == "<=" ||
           cur().text == ">=")) {
        op = next().text;
      } else if (eat_name("in")) {
        op = "in";
      } else if (is_name("not") && t_[i_ + 1].type == Tok::Name && t_[i_ + 1].text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(EK::Compare, pos);
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(binary_level(2));
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr unary_expr(bool with_filters) {
    Nest nest(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& op = next();
      e = unary(op.text == "-" ? EK::Neg : EK::Pos, op.pos, unary_expr(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filters) e = filters(std::move(e));
    return e;
  }

  ExprPtr primary() {
    const Token& tk = cur();
    switch (tk.type) {
      case Tok::Name: {
        ++i_;
        auto e = make(EK::Literal, tk.pos);
        if (tk.text == "true" || tk.text == "True") e->value = true;
        else if (tk.text == "false" || tk.text == "False") e->value = false;
        else if (tk.text == "none" || tk.text == "None") e->value = nullptr;
        else {
          e->kind = EK::Name;
          e->name = tk.text;
        }
        return e;
      }
      case Tok::String: {
        auto e = make(EK::Literal, tk.pos);
        std::string s;
        while (cur().type == Tok::String) s += next().text;  // adjacent literals join, as in Python
        e->value = s;
        return e;
      }
      case Tok::Int:
      case Tok::Float: {
        ++i_;
        auto e = make(EK::Literal, tk.pos);
        if (tk.type == Tok::Int) e->value = tk.i;
        else e->value = tk.f;
        return e;
      }
      case Tok::Op:
        if (tk.text == "(") {
          ++i_;
          auto list = make(EK::List, tk.pos);  // a tuple
          if (eat_op(")")) return list;
          ExprPtr first = expression();
          if (eat_op(")")) return first;  // just parentheses
          list->kids.push_back(std::move(first));
          while (eat_op(",") && !is_op(")")) list->kids.push_back(expression());
          expect_op(")");
          return list;
        }
        if (tk.text == "[") {
          ++i_;
          auto list = make(EK::List, tk.pos);
          comma_list("]", [&] { list->kids.push_back(expression()); });
          return list;
        }
        if (tk.text == "{") {
          ++i_;
          auto dict = make(EK::Dict, tk.pos);
          comma_list("}", [&] {
            dict->kids.push_back(expression());
            expect_op(":");
            dict->kids.push_back(expression());
          });
          return dict;
        }
        break;
      default: break;
    }
    unexpected("an expression");
  }

  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".")) {
        size_t pos = next().pos;
        if (cur().type == Tok::Int) {  // x.0 is x[0]
          auto item = make(EK::Item, pos);
          item->kids.push_back(std::move(e));
          auto idx = make(EK::Literal, cur().pos);
          idx->value = next().i;
          item->kids.push_back(std::move(idx));
          e = std::move(item);
          continue;
        }
        auto a = make(EK::Attr, pos);
        a->name = expect_name("an attribute name after '.'");
        a->kids.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        e = subscript(std::move(e));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr obj) {
    size_t pos = next().pos;  // '['
    ExprPtr parts[3];
    int colons = 0;
    for (;;) {
      if (is_op("]")) break;
      if (eat_op(":")) {
        if (++colons > 2) fail("a slice has at most two ':'");
        continue;
      }
      if (parts[colons]) unexpected("':' or ']'");
      parts[colons] = expression();
    }
    ++i_;
    if (colons == 0) {
      if (!parts[0]) fail("empty subscript '[]'");
      auto e = make(EK::Item, pos);
      e->kids.push_back(std::move(obj));
      e->kids.push_back(std::move(parts[0]));
      return e;
    }
    auto e = make(EK::Slice, pos);
    e->kids.push_back(std::move(obj));
    for (auto& p : parts) e->kids.push_back(std::move(p));
    return e;
  }

  // "(" args ")" where an arg is an expression or name=expression.
  std::vector<Arg> call_args() {
    expect_op("(");
    std::vector<Arg> args;
    comma_list(")", [&] {
      Arg a;
      if (cur().type == Tok::Name && t_[i_ + 1].type == Tok::Op && t_[i_ + 1].text == "=") {
        a.name = next().text;
        ++i_;
      } else if (!args.empty() && !args.back().name.empty()) {
        fail("a positional argument after a keyword argument");
      }
      a.value = expression();
      args.push_back(std::move(a));
    });
    return args;
  }

  ExprPtr call(ExprPtr callee) {
    auto e = make(EK::Call, cur().pos);
    e->kids.push_back(std::move(callee));
    e->args = call_args();
    return e;
  }

  ExprPtr filters(ExprPtr e) {
    for (;;) {
      if (is_op("|")) {
        ++i_;
        size_t pos = cur().pos;
        std::string name = expect_name("a filter name after '|'");
        if (!kFilters.count(name)) src_.fail(Kind::Syntax, pos, "unknown filter '" + name + "'");
        auto f = make(EK::Filter, pos);
        f->name = name;
        f->kids.push_back(std::move(e));
        if (is_op("(")) f->args = call_args();
        e = std::move(f);
      } else if (is_name("is")) {
        ++i_;
        auto t = make(EK::Test, cur().pos);
        t->negate = eat_name("not");
        size_t pos = cur().pos;
        std::string name = expect_name("a test name after 'is'");
        if (!kTests.count(name)) src_.fail(Kind::Syntax, pos, "unknown test '" + name + "'");
        t->name = name;
        t->kids.push_back(std::move(e));
        if (is_op("(")) {
          t->args = call_args();
        } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Int ||
                    cur().type == Tok::Float || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          // Jinja's one-argument form without parentheses: "x is divisibleby 3", "x is sameas none"
          if (is_name("is")) fail("tests cannot be chained with 'is'");
          Arg a;
          a.value = postfix(primary());
          t->args.push_back(std::move(a));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  const Source& src_;
  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loops_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Evaluation

struct ChatTemplate::Impl {
  Source src;
  Body body;
};

namespace {

// A value while rendering: JSON data, or what JSON cannot hold (Jinja's Undefined, a namespace(),
// a macro, a for loop's `loop`). Data is shared, never copied on the way: `messages[i].content`
// points into the context's JSON (shared_ptr's aliasing constructor), so a template that walks a
// long conversation does not copy it at every step.
struct Value {
  enum class K : uint8_t { Undefined, Data, Namespace, Macro, Loop } k = K::Undefined;
  std::shared_ptr<const J> p;          // Data: the JSON, owned here or by an enclosing value
  std::shared_ptr<J> ns;               // Namespace: shared, as Python objects are
  const Node* macro = nullptr;         // Macro
  const std::vector<Value>* items = nullptr;  // Loop: the items, with index and length below
  int64_t index = 0, length = 0;
  std::string why;                     // Undefined: what was missing, for errors ("'x' is undefined")

  const J& j() const { return *p; }
  static Value data(J v) {
    Value r;
    r.k = K::Data;
    r.p = std::make_shared<const J>(std::move(v));
    return r;
  }
  // Part of `owner`'s JSON (or, with an empty owner, JSON that outlives the render).
  static Value child(const std::shared_ptr<const J>& owner, const J& part) {
    Value r;
    r.k = K::Data;
    r.p = std::shared_ptr<const J>(owner, &part);
    return r;
  }
  static Value undefined(std::string why) {
    Value r;
    r.why = std::move(why);
    return r;
  }
  bool is_undefined() const { return k == K::Undefined; }
  bool is_data() const { return k == K::Data; }
};

// Variables of one level: the context, a loop pass, a macro call. Few names each, so a vector.
struct Scope {
  Scope* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;
  Value* find(const std::string& name) {
    for (Scope* s = this; s; s = s->parent)
      for (auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

const char* type_name(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined: return "Undefined";
    case Value::K::Namespace: return "Namespace";
    case Value::K::Macro: return "Macro";
    case Value::K::Loop: return "LoopContext";
    case Value::K::Data: break;
  }
  switch (v.j().type()) {
    case J::value_t::null: return "NoneType";
    case J::value_t::boolean: return "bool";
    case J::value_t::number_integer:
    case J::value_t::number_unsigned: return "int";
    case J::value_t::number_float: return "float";
    case J::value_t::string: return "str";
    case J::value_t::array: return "list";
    case J::value_t::object: return "dict";
    default: return "value";
  }
}

[[noreturn]] void undefined_error(const Value& v) { throw Fail{v.why.empty() ? "a value is undefined" : v.why}; }

// The JSON inside a value, for places that need data (lists, tojson, arithmetic).
const J& data_of(const Value& v) {
  if (v.is_data()) return v.j();
  if (v.is_undefined()) undefined_error(v);
  throw Fail{std::string("a ") + type_name(v) + " cannot be used as a value here"};
}

bool truthy(const Value& v) {
  if (v.k != Value::K::Data) return v.k != Value::K::Undefined;
  const J& j = v.j();
  switch (j.type()) {
    case J::value_t::null: return false;
    case J::value_t::boolean: return j.get<bool>();
    case J::value_t::number_integer: return j.get<int64_t>() != 0;
    case J::value_t::number_unsigned: return j.get<uint64_t>() != 0;
    case J::value_t::number_float: return j.get<double>() != 0;
    case J::value_t::string: return !j.get_ref<const std::string&>().empty();  // json::empty() is false for strings
    case J::value_t::array:
    case J::value_t::object: return !j.empty();
    default: return false;
  }
}

std::string to_str(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined: return "";
    case Value::K::Data: return py_str(v.j());
    case Value::K::Namespace: return "<Namespace " + py_str(*v.ns) + ">";
    case Value::K::Macro: return "<Macro '" + v.macro->names[0] + "'>";
    case Value::K::Loop: return "<LoopContext " + std::to_string(v.index + 1) + "/" + std::to_string(v.length) + ">";
  }
  return "";
}

// Python numbers: bool is an int (True + 1 == 2).
bool is_num(const J& j) { return j.is_number() || j.is_boolean(); }
bool is_int(const J& j) { return j.is_number_integer() || j.is_number_unsigned() || j.is_boolean(); }
int64_t int_of(const J& j) {
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_unsigned()) {
    uint64_t u = j.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) throw Fail{"integer too large"};
    return int64_t(u);
  }
  return j.get<int64_t>();
}
double num_of(const J& j) { return j.is_boolean() ? double(j.get<bool>()) : j.get<double>(); }

bool py_eq(const J& a, const J& b, int depth = 0) {
  check_depth(depth);
  if (is_num(a) && is_num(b)) return is_int(a) && is_int(b) ? int_of(a) == int_of(b) : num_of(a) == num_of(b);
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!py_eq(a[i], b[i], depth + 1)) return false;
    return true;
  }
  if (a.is_object()) {  // dicts are equal whatever their key order
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      auto o = b.find(it.key());
      if (o == b.end() || !py_eq(it.value(), *o, depth + 1)) return false;
    }
    return true;
  }
  return a == b;
}

bool values_eq(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.k == Value::K::Namespace || b.k == Value::K::Namespace) return a.ns == b.ns;
  if (a.k == Value::K::Macro || b.k == Value::K::Macro) return a.macro == b.macro;
  return py_eq(a.j(), b.j());
}

// a < b for Python's orderable pairs: numbers, strings, lists.
bool py_lt(const J& a, const J& b, const char* op, int depth = 0) {
  check_depth(depth);
  if (is_num(a) && is_num(b)) return is_int(a) && is_int(b) ? int_of(a) < int_of(b) : num_of(a) < num_of(b);
  if (a.is_string() && b.is_string()) return a.get_ref<const std::string&>() < b.get_ref<const std::string&>();
  if (a.is_array() && b.is_array()) {
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      if (!py_eq(a[i], b[i], depth + 1)) return py_lt(a[i], b[i], op, depth + 1);
    return a.size() < b.size();
  }
  throw Fail{std::string("'") + op + "' is not supported between '" + type_name(Value::data(a)) + "' and '" +
             type_name(Value::data(b)) + "'"};
}

bool contains(const Value& container, const Value& item) {
  if (container.is_undefined()) return false;
  const J& c = data_of(container);
  if (c.is_string()) {
    if (!item.is_data() || !item.j().is_string())
      throw Fail{std::string("'in <string>' needs a string on the left, not '") + type_name(item) + "'"};
    return c.get_ref<const std::string&>().find(item.j().get_ref<const std::string&>()) != std::string::npos;
  }
  if (c.is_array()) {
    for (const auto& x : c)
      if (values_eq(Value::data(x), item)) return true;
    return false;
  }
  if (c.is_object()) return item.is_data() && item.j().is_string() && c.contains(item.j().get<std::string>());
  throw Fail{std::string("argument of type '") + type_name(container) + "' is not iterable"};
}

bool compare(const Value& a, const std::string& op, const Value& b) {
  if (op == "==") return values_eq(a, b);
  if (op == "!=") return !values_eq(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  const J& x = data_of(a);
  const J& y = data_of(b);
  if (op == "<") return py_lt(x, y, "<");
  if (op == ">") return py_lt(y, x, ">");
  if (op == "<=") return !py_lt(y, x, "<=");
  return !py_lt(x, y, ">=");  // ">="
}

// The items a for loop or a filter walks: list elements, dict keys, string code points.
std::vector<Value> iterate(const Value& v) {
  if (v.is_undefined()) return {};
  const J& j = data_of(v);
  std::vector<Value> out;
  if (j.is_array()) {
    out.reserve(j.size());
    for (const auto& x : j) out.push_back(Value::child(v.p, x));
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Value::data(it.key()));
  } else if (j.is_string()) {
    for (auto cp : code_points(j.get_ref<const std::string&>())) out.push_back(Value::data(std::string(cp)));
  } else {
    throw Fail{std::string("'") + type_name(v) + "' object is not iterable"};
  }
  return out;
}

J to_list(const std::vector<Value>& items) {
  J out = J::array();
  for (const auto& x : items) out.push_back(x.j());
  return out;
}

int64_t length_of(const Value& v) {
  if (v.is_undefined()) return 0;
  const J& j = data_of(v);
  if (j.is_string()) return int64_t(code_points(j.get_ref<const std::string&>()).size());
  if (j.is_array() || j.is_object()) return int64_t(j.size());
  throw Fail{std::string("object of type '") + type_name(v) + "' has no len()"};
}

// Python's ints do not overflow; k3's stop with an error instead of wrapping.
int64_t int_op(char op, int64_t a, int64_t b) {
  int64_t r = 0;
  bool overflow = op == '+' ? __builtin_add_overflow(a, b, &r) : op == '-' ? __builtin_sub_overflow(a, b, &r)
                                                                           : __builtin_mul_overflow(a, b, &r);
  if (overflow) throw Fail{"integer overflow (k3's template integers are 64-bit)"};
  return r;
}

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::data(to_str(a) + to_str(b));
  const J& x = data_of(a);
  const J& y = data_of(b);
  auto bad = [&]() -> Value {
    throw Fail{"unsupported operand types for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'"};
  };
  if (op == "+") {
    if (x.is_string() && y.is_string())
      return Value::data(x.get_ref<const std::string&>() + y.get_ref<const std::string&>());
    if (x.is_array() && y.is_array()) {
      J r = x;
      for (const auto& e : y) r.push_back(e);
      return Value::data(std::move(r));
    }
  }
  const bool x_seq = x.is_string() || x.is_array(), y_seq = y.is_string() || y.is_array();
  if (op == "*" && ((x_seq && is_int(y)) || (is_int(x) && y_seq))) {  // "=" * 10, [0] * 3
    const J& seq = x_seq ? x : y;
    int64_t n = int_of(x_seq ? y : x);
    size_t unit = seq.is_string() ? seq.get_ref<const std::string&>().size() : seq.size();
    size_t limit = seq.is_string() ? kMaxOutput : size_t(kMaxRange);
    if (n > 0 && unit > 0 && size_t(n) > limit / unit) throw Fail{"a repeated sequence would be too long"};
    J r = seq.is_string() ? J("") : J::array();
    for (int64_t i = 0; i < n; ++i) {
      if (seq.is_string()) r.get_ref<std::string&>() += seq.get_ref<const std::string&>();
      else
        for (const auto& e : seq) r.push_back(e);
    }
    return Value::data(std::move(r));
  }
  if (!is_num(x) || !is_num(y)) return bad();
  const bool ints = is_int(x) && is_int(y);
  if (op == "/") {
    if (num_of(y) == 0) throw Fail{"division by zero"};
    return Value::data(num_of(x) / num_of(y));
  }
  if (ints) {
    int64_t p = int_of(x), q = int_of(y);
    if (op == "+" || op == "-" || op == "*") return Value::data(int_op(op[0], p, q));
    if (op == "//" || op == "%") {
      if (q == 0) throw Fail{"division by zero"};
      if (p == std::numeric_limits<int64_t>::min() && q == -1) throw Fail{"integer overflow"};
      int64_t d = p / q, m = p % q;
      if (m != 0 && ((m < 0) != (q < 0))) d -= 1, m += q;  // Python floors
      return Value::data(op == "//" ? d : m);
    }
    if (op == "**" && q >= 0) {
      int64_t acc = 1;
      if (p == 0 || p == 1) acc = p == 0 && q > 0 ? 0 : 1;
      else if (p == -1) acc = q % 2 ? -1 : 1;
      else
        for (int64_t i = 0; i < q; ++i) acc = int_op('*', acc, p);  // overflows within 63 steps
      return Value::data(acc);
    }
  }
  double p = num_of(x), q = num_of(y);
  if (op == "+") return Value::data(p + q);
  if (op == "-") return Value::data(p - q);
  if (op == "*") return Value::data(p * q);
  if (op == "**") return Value::data(std::pow(p, q));
  if (q == 0) throw Fail{"division by zero"};
  // CPython's float divmod: the remainder from fmod, so that 4 // 0.1 is 39.0 as in Python, not 40.0.
  double mod = std::fmod(p, q), div = (p - mod) / q;
  if (mod != 0) {
    if ((q < 0) != (mod < 0)) mod += q, div -= 1.0;
  } else {
    mod = std::copysign(0.0, q);
  }
  double fl = std::copysign(0.0, p / q);
  if (div != 0) {
    fl = std::floor(div);
    if (div - fl > 0.5) fl += 1.0;
  }
  return Value::data(op == "//" ? fl : mod);  // "%"
}

// Python slicing a[start:stop:step] of n items: the indices taken.
std::vector<size_t> slice_indices(int64_t n, const Value* start, const Value* stop, const Value* step) {
  auto get = [](const Value* v, int64_t dflt) {
    if (!v || (v->is_data() && v->j().is_null())) return dflt;
    const J& j = data_of(*v);
    if (!is_int(j)) throw Fail{"slice indices must be integers or none"};
    return int_of(j);
  };
  int64_t st = get(step, 1);
  if (st == 0) throw Fail{"slice step cannot be zero"};
  auto clamp = [&](int64_t i, int64_t lo, int64_t hi) {
    if (i < 0) i += n;
    return std::clamp(i, lo, hi);
  };
  int64_t b = st > 0 ? clamp(get(start, 0), 0, n) : clamp(get(start, n - 1), -1, n - 1);
  int64_t e = st > 0 ? clamp(get(stop, n), 0, n) : clamp(get(stop, -n - 1), -1, n - 1);
  std::vector<size_t> idx;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) idx.push_back(size_t(i));
  return idx;
}

// Positional and keyword arguments of a call, filter or test, evaluated.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const std::string* fn;

  // Argument `i` by position or by `name`; nullptr when not given.
  const Value* get(size_t i, const char* name) const {
    if (i < pos.size()) return &pos[i];
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return nullptr;
  }
  void allow(size_t max_pos, std::initializer_list<const char*> names) const {
    if (pos.size() > max_pos)
      throw Fail{*fn + "() takes at most " + std::to_string(max_pos) + " positional argument" +
                 (max_pos == 1 ? "" : "s") + " (" + std::to_string(pos.size()) + " given)"};
    for (const auto& arg : kw) {
      const std::string& k = arg.first;
      if (std::find_if(names.begin(), names.end(), [&](const char* n) { return k == n; }) == names.end())
        throw Fail{*fn + "() got an unexpected keyword argument '" + k + "'"};
    }
  }
  std::string str(size_t i, const char* name, const char* dflt) const {
    const Value* v = get(i, name);
    if (!v) {
      if (!dflt) throw Fail{*fn + "() is missing its argument '" + name + "'"};
      return dflt;
    }
    const J& j = data_of(*v);
    if (!j.is_string()) throw Fail{*fn + "(): '" + name + "' must be a string, not '" + type_name(*v) + "'"};
    return j.get<std::string>();
  }
  int64_t integer(size_t i, const char* name, int64_t dflt) const {
    const Value* v = get(i, name);
    if (!v || (v->is_data() && v->j().is_null())) return dflt;
    const J& j = data_of(*v);
    if (!is_int(j)) throw Fail{*fn + "(): '" + name + "' must be an integer, not '" + type_name(*v) + "'"};
    return int_of(j);
  }
  bool boolean(size_t i, const char* name, bool dflt) const {
    const Value* v = get(i, name);
    return v ? truthy(*v) : dflt;
  }
};

const std::string& str_of(const Value& v, const char* what) {
  const J& j = data_of(v);
  if (!j.is_string()) throw Fail{std::string(what) + " needs a string, not '" + type_name(v) + "'"};
  return j.get_ref<const std::string&>();
}

// x.attr / x["key"]: a dict's key, a namespace's attribute, else undefined (Jinja's getattr).
Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.k == Value::K::Loop) {
    const int64_t i = obj.index, n = obj.length;
    if (name == "index0") return Value::data(i);
    if (name == "index") return Value::data(i + 1);
    if (name == "revindex0") return Value::data(n - i - 1);
    if (name == "revindex") return Value::data(n - i);
    if (name == "first") return Value::data(i == 0);
    if (name == "last") return Value::data(i == n - 1);
    if (name == "length") return Value::data(n);
    if (name == "depth") return Value::data(1);
    if (name == "depth0") return Value::data(0);
    if (name == "previtem" && i > 0) return (*obj.items)[size_t(i - 1)];
    if (name == "nextitem" && i + 1 < n) return (*obj.items)[size_t(i + 1)];
    if (name == "previtem" || name == "nextitem") return Value::undefined("there is no " + name.substr(0, 4) + " item");
    return Value::undefined("loop has no attribute '" + name + "' in k3's template renderer");
  }
  if (obj.k == Value::K::Namespace) {
    auto it = obj.ns->find(name);
    return it == obj.ns->end() ? Value::undefined("the namespace has no attribute '" + name + "'") : Value::data(*it);
  }
  if (obj.is_data() && obj.j().is_object()) {
    auto it = obj.j().find(name);
    if (it != obj.j().end()) return Value::child(obj.p, *it);
  }
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + name + "'");
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) undefined_error(obj);
  if (key.is_data() && key.j().is_string()) return get_attr(obj, key.j().get_ref<const std::string&>());
  const bool indexable = obj.is_data() && (obj.j().is_array() || obj.j().is_string());
  if (indexable && key.is_data() && is_int(key.j()) && !key.j().is_boolean()) {
    int64_t i = int_of(key.j());
    if (obj.j().is_array()) {
      int64_t n = int64_t(obj.j().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value::child(obj.p, obj.j()[size_t(i)]);
    } else {
      auto cps = code_points(obj.j().get_ref<const std::string&>());
      int64_t n = int64_t(cps.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value::data(std::string(cps[size_t(i)]));
    }
    return Value::undefined(std::string("index ") + std::to_string(int_of(key.j())) + " is out of range");
  }
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no item " + to_str(key));
}

// `is` tests.
bool run_test(const std::string& name, const Value& v, const Args& a) {
  const J* j = v.is_data() ? &v.j() : nullptr;
  auto arg = [&]() -> const Value& {
    if (a.pos.empty()) throw Fail{"the test '" + name + "' needs an argument"};
    return a.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return j && j->is_null();
  if (name == "string") return j && j->is_string();
  if (name == "number") return j && is_num(*j);
  if (name == "integer") return j && (j->is_number_integer() || j->is_number_unsigned());
  if (name == "float") return j && j->is_number_float();
  if (name == "boolean") return j && j->is_boolean();
  if (name == "true") return j && j->is_boolean() && j->get<bool>();
  if (name == "false") return j && j->is_boolean() && !j->get<bool>();
  if (name == "mapping") return j && j->is_object();
  if (name == "iterable" || name == "sequence")  // Jinja's Undefined iterates as empty
    return !j ? v.is_undefined() : j->is_string() || j->is_array() || j->is_object();
  if (name == "lower" || name == "upper") {
    if (!j || !j->is_string()) return false;
    const std::string& s = j->get_ref<const std::string&>();
    auto conv = name == "lower" ? ascii_map(s, [](int c) { return std::tolower(c); })
                                : ascii_map(s, [](int c) { return std::toupper(c); });
    return conv == s;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    const Value two = Value::data(2);
    const Value m = arithmetic("%", v, name == "divisibleby" ? arg() : two);  // Python: value % 2 == 1
    return py_eq(m.j(), J(name == "odd" ? 1 : 0));
  }
  if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") return compare(v, "==", arg());
  if (name == "ne" || name == "!=") return compare(v, "!=", arg());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, "<", arg());
  if (name == "le" || name == "<=") return compare(v, "<=", arg());
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, ">", arg());
  if (name == "ge" || name == ">=") return compare(v, ">=", arg());
  if (name == "in") return contains(arg(), v);
  throw Fail{"unknown test '" + name + "'"};
}

Value tojson(const Value& v, const Args& a) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  a.allow(4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  DumpOptions o;
  o.ensure_ascii = a.boolean(0, "ensure_ascii", false);
  o.indent = int(std::clamp<int64_t>(a.integer(1, "indent", -1), -1, 64));
  if (o.indent >= 0) o.item_sep = ",";
  if (const Value* sep = a.get(2, "separators"); sep && !(sep->is_data() && sep->j().is_null())) {
    const J& s = data_of(*sep);
    if (!s.is_array() || s.size() != 2 || !s[0].is_string() || !s[1].is_string())
      throw Fail{"tojson(): separators must be a pair of strings"};
    o.item_sep = s[0].get<std::string>();
    o.key_sep = s[1].get<std::string>();
  }
  o.sort_keys = a.boolean(3, "sort_keys", false);
  std::string out;
  if (v.is_undefined()) undefined_error(v);
  dump_json(out, data_of(v), o, 0);
  return Value::data(std::move(out));
}

// str methods and dict methods: x.strip(), x.split(","), d.get("k"), d.items(), ...
Value call_method(const Value& obj, const std::string& name, const Args& a) {
  if (obj.is_undefined()) undefined_error(obj);
  const J& j = data_of(obj);
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      a.allow(1, {"chars"});
      const Value* c = a.get(0, "chars");
      std::string chars;
      const bool given = c && !(c->is_data() && c->j().is_null());
      if (given) chars = str_of(*c, "strip()");
      return Value::data(py_strip(s, given ? &chars : nullptr, name != "rstrip", name != "lstrip"));
    }
    if (name == "startswith" || name == "endswith") {
      a.allow(1, {});
      if (a.pos.empty()) throw Fail{name + "() takes one argument"};
      const J& p = data_of(a.pos[0]);
      std::vector<std::string> cands;
      if (p.is_string()) cands.push_back(p.get<std::string>());
      else if (p.is_array())
        for (const auto& x : p) cands.push_back(str_of(Value::data(x), name.c_str()));
      else
        throw Fail{name + "() needs a string or a list of strings, not '" + type_name(a.pos[0]) + "'"};
      for (const auto& c : cands) {
        if (c.size() > s.size()) continue;
        if (name == "startswith" ? s.compare(0, c.size(), c) == 0 : s.compare(s.size() - c.size(), c.size(), c) == 0)
          return Value::data(true);
      }
      return Value::data(false);
    }
    if (name == "split") {
      a.allow(2, {"sep", "maxsplit"});
      const Value* sep = a.get(0, "sep");
      std::string sv;
      const bool given = sep && !(sep->is_data() && sep->j().is_null());
      if (given) sv = str_of(*sep, "split()");
      return Value::data(py_split(s, given ? &sv : nullptr, a.integer(1, "maxsplit", -1)));
    }
    if (name == "upper" || name == "lower") {
      a.allow(0, {});
      return Value::data(ascii_map(s, name == "upper" ? +[](int c) { return std::toupper(c); }
                                                      : +[](int c) { return std::tolower(c); }));
    }
    if (name == "title") return Value::data(ascii_title(s));
    if (name == "capitalize") return Value::data(ascii_capitalize(s));
    if (name == "replace") {
      a.allow(3, {"old", "new", "count"});
      return Value::data(py_replace(s, a.str(0, "old", nullptr), a.str(1, "new", nullptr), a.integer(2, "count", -1)));
    }
    if (name == "join") {
      a.allow(1, {});
      if (a.pos.empty()) throw Fail{"join() takes one argument"};
      std::string out;
      bool first = true;
      for (const auto& x : iterate(a.pos[0])) {
        out += (first ? "" : s) + str_of(x, "join()");
        first = false;
      }
      return Value::data(std::move(out));
    }
    throw Fail{"strings have no method '" + name + "' in k3's template renderer"};
  }
  if (j.is_object()) {
    if (name == "get") {
      a.allow(2, {});
      if (a.pos.empty()) throw Fail{"get() takes a key"};
      Value r = get_item(obj, a.pos[0]);
      if (!r.is_undefined()) return r;
      return a.pos.size() > 1 ? a.pos[1] : Value::data(nullptr);
    }
    if (name == "items" || name == "keys" || name == "values") {
      a.allow(0, {});
      J out = J::array();
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (name == "items") out.push_back(J::array({it.key(), it.value()}));
        else if (name == "keys") out.push_back(it.key());
        else out.push_back(it.value());
      }
      return Value::data(std::move(out));
    }
    // A dict key holding... nothing callable: JSON holds no functions.
    throw Fail{"dicts have no method '" + name + "' in k3's template renderer"};
  }
  throw Fail{std::string("'") + type_name(obj) + "' object has no method '" + name + "'"};
}

class Renderer {
 public:
  Renderer(const ChatTemplate::Impl& t, const J& context) : t_(t) {
    if (!context.is_object()) throw TemplateError(Kind::Render, "the context must be a JSON object", 0, 0);
    // The context outlives the render: its values are borrowed, not copied.
    for (auto it = context.begin(); it != context.end(); ++it) root_.set(it.key(), Value::child(nullptr, it.value()));
  }

  std::string run() {
    exec(t_.body, root_);
    return std::move(out_);
  }

 private:
  enum class Flow { Normal, Break, Continue };

  void step(size_t pos) {
    if (++steps_ > kMaxSteps)
      t_.src.fail(Kind::Render, pos, "the template ran for more than " + std::to_string(kMaxSteps) + " steps");
  }

  void emit(const std::string& s, size_t pos) {
    if (out_.size() + s.size() > kMaxOutput)
      t_.src.fail(Kind::Render, pos, "the output exceeds " + std::to_string(kMaxOutput >> 20) + " MiB");
    out_ += s;
  }

  // Renders a body into a string of its own ({% set x %}...{% endset %}, macro calls).
  std::string capture(const Body& b, Scope& s) {
    std::string saved = std::move(out_);
    out_.clear();
    exec(b, s);
    return std::exchange(out_, std::move(saved));
  }

  Flow exec(const Body& body, Scope& s) {
    for (const auto& n : body) {
      step(n->pos);
      Flow f = exec_node(*n, s);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec_node(const Node& n, Scope& s) {
    switch (n.kind) {
      case NK::Text: emit(n.text, n.pos); return Flow::Normal;
      case NK::Output: emit(to_str(eval(*n.exprs[0], s)), n.pos); return Flow::Normal;
      case NK::If:
        for (size_t b = 0; b < n.bodies.size(); ++b)
          if (b == n.exprs.size() || truthy(eval(*n.exprs[b], s))) return exec(n.bodies[b], s);
        return Flow::Normal;
      case NK::For: return exec_for(n, s);
      case NK::Set: {
        Value v = eval(*n.exprs[0], s);
        if (n.names.size() == 1) {
          s.set(n.names[0], std::move(v));
          return Flow::Normal;
        }
        Value* ns = s.find(n.names[0]);
        if (!ns || ns->k != Value::K::Namespace)
          t_.src.fail(Kind::Render, n.pos, "'{% set " + n.names[0] + "." + n.names[1] + " %}' needs '" + n.names[0] +
                                               "' to be a namespace(); attributes of other values cannot be set");
        (*ns->ns)[n.names[1]] = at(n.pos, [&]() -> J { return data_of(v); });
        return Flow::Normal;
      }
      case NK::SetBlock: s.set(n.names[0], Value::data(capture(n.bodies[0], s))); return Flow::Normal;
      case NK::Macro: {
        Value m;
        m.k = Value::K::Macro;
        m.macro = &n;
        s.set(n.names[0], m);
        return Flow::Normal;
      }
      case NK::Break: return Flow::Break;
      case NK::Continue: return Flow::Continue;
      case NK::Group: return exec(n.bodies[0], s);
    }
    return Flow::Normal;
  }

  // Runs f, turning a positionless Fail into an error at pos.
  template <class F>
  auto at(size_t pos, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const Fail& e) {
      t_.src.fail(Kind::Render, pos, e.msg);
    }
  }

  void bind(Scope& s, const std::vector<std::string>& names, const Value& item, size_t pos) {
    if (names.size() == 1) {
      s.set(names[0], item);
      return;
    }
    if (!item.is_data() || !item.j().is_array() || item.j().size() != names.size())
      t_.src.fail(Kind::Render, pos, "cannot unpack " + std::string(type_name(item)) + " into " +
                                         std::to_string(names.size()) + " loop variables");
    for (size_t k = 0; k < names.size(); ++k) s.set(names[k], Value::child(item.p, item.j()[k]));
  }

  Flow exec_for(const Node& n, Scope& s) {
    Value seq = eval(*n.exprs[0], s);
    std::vector<Value> items = at(n.exprs[0]->pos, [&] { return iterate(seq); });
    if (n.exprs[1]) {  // {% for x in xs if cond %}: filtered before the loop, so loop.length counts the kept
      std::vector<Value> kept;
      for (auto& it : items) {
        Scope f;
        f.parent = &s;
        bind(f, n.names, it, n.pos);
        if (truthy(eval(*n.exprs[1], f))) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty())  // the else body belongs to the enclosing loop, if any: its break/continue pass up
      return n.bodies.size() > 1 ? exec(n.bodies[1], s) : Flow::Normal;
    const int64_t len = int64_t(items.size());
    for (int64_t k = 0; k < len; ++k) {
      step(n.pos);
      Scope body;  // each pass has its own scope: a {% set %} inside does not outlive it (as in Jinja)
      body.parent = &s;
      bind(body, n.names, items[size_t(k)], n.pos);
      Value loop;
      loop.k = Value::K::Loop;
      loop.items = &items;
      loop.index = k;
      loop.length = len;
      body.set("loop", std::move(loop));
      if (exec(n.bodies[0], body) == Flow::Break) break;
    }
    return Flow::Normal;
  }

  Args eval_args(const std::vector<Arg>& args, Scope& s, const std::string& fn) {
    Args a;
    a.fn = &fn;
    for (const auto& arg : args) {
      if (arg.name.empty()) a.pos.push_back(eval(*arg.value, s));
      else a.kw.emplace_back(arg.name, eval(*arg.value, s));
    }
    return a;
  }

  Value eval(const Expr& e, Scope& s) {
    step(e.pos);
    try {
      return eval_inner(e, s);
    } catch (const Fail& f) {
      t_.src.fail(Kind::Render, e.pos, f.msg);
    }
  }

  Value eval_inner(const Expr& e, Scope& s) {
    switch (e.kind) {
      case EK::Literal: return Value::child(nullptr, e.value);  // the template outlives the render
      case EK::Name: {
        if (Value* v = s.find(e.name)) return *v;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case EK::Attr: return get_attr(eval(*e.kids[0], s), e.name);
      case EK::Item: {
        Value obj = eval(*e.kids[0], s);
        return get_item(obj, eval(*e.kids[1], s));
      }
      case EK::Slice: return slice(e, s);
      case EK::Call: return call(e, s);
      case EK::Filter: {
        Value v = eval(*e.kids[0], s);
        return filter(e.name, v, eval_args(e.args, s, e.name), s);
      }
      case EK::Test: {
        Value v = eval(*e.kids[0], s);
        return Value::data(run_test(e.name, v, eval_args(e.args, s, e.name)) != e.negate);
      }
      case EK::Neg:
      case EK::Pos: {
        Value v = eval(*e.kids[0], s);
        const J& j = data_of(v);
        if (!is_num(j))
          throw Fail{std::string("bad operand type for unary ") + (e.kind == EK::Neg ? "-" : "+") + ": '" +
                     type_name(v) + "'"};
        if (e.kind == EK::Pos) return Value::data(is_int(j) ? J(int_of(j)) : j);
        if (is_int(j)) {
          if (int_of(j) == std::numeric_limits<int64_t>::min()) throw Fail{"integer overflow"};
          return Value::data(-int_of(j));
        }
        return Value::data(-j.get<double>());
      }
      case EK::Not: return Value::data(!truthy(eval(*e.kids[0], s)));
      case EK::And: {
        Value a = eval(*e.kids[0], s);
        return truthy(a) ? eval(*e.kids[1], s) : a;
      }
      case EK::Or: {
        Value a = eval(*e.kids[0], s);
        return truthy(a) ? a : eval(*e.kids[1], s);
      }
      case EK::Binary: {
        Value a = eval(*e.kids[0], s);
        return arithmetic(e.name, a, eval(*e.kids[1], s));
      }
      case EK::Compare: {
        Value left = eval(*e.kids[0], s);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.kids[k + 1], s);
          if (!compare(left, e.ops[k], right)) return Value::data(false);
          left = std::move(right);
        }
        return Value::data(true);
      }
      case EK::Cond:
        if (truthy(eval(*e.kids[1], s))) return eval(*e.kids[0], s);
        if (e.kids[2]) return eval(*e.kids[2], s);
        return Value::undefined("the inline 'if' was false and has no 'else'");
      case EK::List: {
        J out = J::array();
        for (const auto& k : e.kids) out.push_back(data_of(eval(*k, s)));
        return Value::data(std::move(out));
      }
      case EK::Dict: {
        J out = J::object();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = eval(*e.kids[k], s);
          out[str_of(key, "a dict key")] = data_of(eval(*e.kids[k + 1], s));
        }
        return Value::data(std::move(out));
      }
    }
    throw Fail{"unknown expression"};
  }

  Value slice(const Expr& e, Scope& s) {
    Value obj = eval(*e.kids[0], s);
    std::optional<Value> parts[3];
    for (int k = 0; k < 3; ++k)
      if (e.kids[size_t(k) + 1]) parts[k] = eval(*e.kids[size_t(k) + 1], s);
    auto p = [&](int k) { return parts[k] ? &*parts[k] : nullptr; };
    const J& j = data_of(obj);
    if (j.is_array()) {
      J out = J::array();
      for (size_t i : slice_indices(int64_t(j.size()), p(0), p(1), p(2))) out.push_back(j[i]);
      return Value::data(std::move(out));
    }
    if (j.is_string()) {
      auto cps = code_points(j.get_ref<const std::string&>());
      std::string out;
      for (size_t i : slice_indices(int64_t(cps.size()), p(0), p(1), p(2))) out += cps[i];
      return Value::data(std::move(out));
    }
    throw Fail{std::string("'") + type_name(obj) + "' object cannot be sliced"};
  }

  Value call(const Expr& e, Scope& s) {
    const Expr& callee = *e.kids[0];
    if (callee.kind == EK::Attr) {  // a method: x.strip(), d.items()
      Value obj = eval(*callee.kids[0], s);
      if (obj.k == Value::K::Namespace || (obj.is_data() && obj.j().is_object() && obj.j().contains(callee.name) &&
                                            callee.name != "get" && callee.name != "items" && callee.name != "keys" &&
                                            callee.name != "values"))
        throw Fail{"'" + callee.name + "' is not callable"};
      return call_method(obj, callee.name, eval_args(e.args, s, callee.name));
    }
    if (callee.kind == EK::Name) {
      Value* v = s.find(callee.name);
      if (v && v->k == Value::K::Macro) return call_macro(*v->macro, eval_args(e.args, s, callee.name));
      if (!v) return builtin(callee.name, eval_args(e.args, s, callee.name), e.pos);
      throw Fail{"'" + callee.name + "' is a " + type_name(*v) + ", not a function"};
    }
    Value v = eval(callee, s);
    if (v.is_undefined()) undefined_error(v);
    throw Fail{std::string("a '") + type_name(v) + "' value is not callable"};
  }

  Value builtin(const std::string& name, const Args& a, size_t pos) {
    if (name == "raise_exception") {
      std::string msg = a.pos.empty() ? std::string("raise_exception() was called") : to_str(a.pos[0]);
      t_.src.fail(Kind::Raised, pos, msg);
    }
    if (name == "namespace" || name == "dict") {
      J obj = J::object();
      for (const auto& p : a.pos) {
        const J& j = data_of(p);
        if (!j.is_object()) throw Fail{name + "() takes a dict or keyword arguments"};
        for (auto it = j.begin(); it != j.end(); ++it) obj[it.key()] = it.value();
      }
      for (const auto& [k, v] : a.kw) obj[k] = data_of(v);
      if (name == "dict") return Value::data(std::move(obj));
      Value ns;
      ns.k = Value::K::Namespace;
      ns.ns = std::make_shared<J>(std::move(obj));
      return ns;
    }
    if (name == "range") {
      a.allow(3, {});
      if (a.pos.empty()) throw Fail{"range() needs at least one argument"};
      int64_t b = a.pos.size() > 1 ? a.integer(0, "start", 0) : 0;
      int64_t e = a.pos.size() > 1 ? a.integer(1, "stop", 0) : a.integer(0, "stop", 0);
      int64_t st = a.integer(2, "step", 1);
      if (st == 0) throw Fail{"range() step must not be zero"};
      J out = J::array();
      for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
        if (int64_t(out.size()) >= kMaxRange)
          throw Fail{"range() of more than " + std::to_string(kMaxRange) + " items"};
        out.push_back(i);
      }
      return Value::data(std::move(out));
    }
    if (name == "strftime_now") {  // transformers provides it (Llama 3.x templates print today's date)
      std::string fmt = a.str(0, "format", nullptr);
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
      return Value::data(std::string(buf, n));
    }
    throw Fail{"'" + name + "' is undefined (not a variable, macro or known function)"};
  }

  Value call_macro(const Node& m, const Args& a) {
    if (++call_depth_ > kMaxCallDepth) throw Fail{"macro calls nest deeper than " + std::to_string(kMaxCallDepth)};
    const size_t nparams = m.names.size() - 1;
    if (a.pos.size() > nparams)
      throw Fail{"macro '" + m.names[0] + "' takes " + std::to_string(nparams) + " arguments (" +
                 std::to_string(a.pos.size()) + " given)"};
    Scope local;  // a macro sees its arguments and the template's top level, not its caller's loop variables
    local.parent = &root_;
    for (size_t k = 0; k < nparams; ++k) {
      const std::string& p = m.names[k + 1];
      if (k < a.pos.size()) local.set(p, a.pos[k]);
      else if (m.exprs[k]) local.set(p, eval(*m.exprs[k], local));
      else local.set(p, Value::undefined("'" + p + "' is undefined (no argument given to macro '" + m.names[0] + "')"));
    }
    for (const auto& [k, v] : a.kw) {
      auto it = std::find(m.names.begin() + 1, m.names.end(), k);
      if (it == m.names.end()) throw Fail{"macro '" + m.names[0] + "' has no parameter '" + k + "'"};
      local.set(k, v);
    }
    std::string out = capture(m.bodies[0], local);
    --call_depth_;
    return Value::data(std::move(out));
  }

  // Applies a filter by name to one value (map() and select() reuse this for every item).
  Value filter(const std::string& name, const Value& v, const Args& a, Scope& s) {
    if (name == "tojson") return tojson(v, a);
    if (name == "default" || name == "d") {
      a.allow(2, {"default_value", "boolean"});
      const Value* dflt = a.get(0, "default_value");
      bool use = a.boolean(1, "boolean", false) ? !truthy(v) : v.is_undefined();
      if (!use) return v;
      return dflt ? *dflt : Value::data("");
    }
    if (name == "length" || name == "count") return Value::data(length_of(v));
    if (name == "safe") return v;
    if (name == "string") return Value::data(to_str(v));
    if (name == "trim") {
      a.allow(1, {"chars"});
      const Value* c = a.get(0, "chars");
      std::string chars;
      if (c) chars = str_of(*c, "trim");
      return Value::data(py_strip(to_str(v), c ? &chars : nullptr, true, true));
    }
    if (name == "upper") return Value::data(ascii_map(to_str(v), [](int c) { return std::toupper(c); }));
    if (name == "lower") return Value::data(ascii_map(to_str(v), [](int c) { return std::tolower(c); }));
    if (name == "capitalize") return Value::data(ascii_capitalize(to_str(v)));
    if (name == "title") return Value::data(ascii_title(to_str(v)));
    if (name == "replace") {
      a.allow(3, {"old", "new", "count"});
      return Value::data(
          py_replace(to_str(v), a.str(0, "old", nullptr), a.str(1, "new", nullptr), a.integer(2, "count", -1)));
    }
    if (name == "int" || name == "float") return number_filter(name, v, a);
    if (name == "abs") {
      const J& j = data_of(v);
      if (!is_num(j)) throw Fail{"abs() needs a number, not '" + std::string(type_name(v)) + "'"};
      if (is_int(j)) return Value::data(int_of(j) < 0 ? int_op('-', 0, int_of(j)) : int_of(j));
      return Value::data(std::fabs(j.get<double>()));
    }
    if (name == "first" || name == "last") {
      std::vector<Value> items = iterate(v);
      if (items.empty()) return Value::undefined("|" + name + " of an empty sequence");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::data(to_list(iterate(v)));
    if (name == "reverse") {
      if (v.is_data() && v.j().is_string()) {
        auto cps = code_points(v.j().get_ref<const std::string&>());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::data(std::move(out));
      }
      std::vector<Value> items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::data(to_list(items));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::data(J::array());
      return call_method(v, "items", Args{{}, {}, &name});
    }
    if (name == "unique") {
      J out = J::array();
      for (auto& x : iterate(v))
        if (std::none_of(out.begin(), out.end(), [&](const J& y) { return py_eq(x.j(), y); })) out.push_back(x.j());
      return Value::data(std::move(out));
    }
    if (name == "join") {
      a.allow(2, {"d", "attribute"});
      std::string sep = a.str(0, "d", "");
      const Value* attr = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (auto& x : iterate(v)) {
        Value item = attr ? get_item(x, *attr) : x;
        out += (first ? "" : sep) + to_str(item);
        first = false;
      }
      return Value::data(std::move(out));
    }
    if (name == "map") {
      J out = J::array();
      const Value* attr = a.get(SIZE_MAX, "attribute");
      if (attr) {
        a.allow(0, {"attribute", "default"});
        const Value* dflt = a.get(SIZE_MAX, "default");
        for (auto& x : iterate(v)) {
          Value item = get_item(x, *attr);
          if (item.is_undefined() && dflt) item = *dflt;
          out.push_back(data_of(item));
        }
        return Value::data(std::move(out));
      }
      if (a.pos.empty()) throw Fail{"map() needs a filter name or attribute="};
      const std::string& fname = str_of(a.pos[0], "map()");
      if (!kFilters.count(fname) || fname == "map") throw Fail{"map(): unknown filter '" + fname + "'"};
      Args rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw, &fname};
      for (auto& x : iterate(v)) out.push_back(data_of(filter(fname, x, rest, s)));
      return Value::data(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name.size() > 6;
      const bool keep_if = name[0] == 's';
      size_t k = 0;
      const Value* attr = nullptr;
      if (by_attr) {
        if (a.pos.empty()) throw Fail{name + "() needs an attribute name"};
        attr = &a.pos[k++];
      }
      std::string test;
      if (k < a.pos.size()) test = str_of(a.pos[k++], name.c_str());
      if (!test.empty() && !kTests.count(test)) throw Fail{name + "(): unknown test '" + test + "'"};
      Args targs{std::vector<Value>(a.pos.begin() + std::ptrdiff_t(k), a.pos.end()), {}, &test};
      J out = J::array();
      for (auto& x : iterate(v)) {
        Value item = attr ? get_item(x, *attr) : x;
        bool pass = test.empty() ? truthy(item) : run_test(test, item, targs);
        if (pass == keep_if) out.push_back(x.j());
      }
      return Value::data(std::move(out));
    }
    throw Fail{"unknown filter '" + name + "'"};
  }

  static Value number_filter(const std::string& name, const Value& v, const Args& a) {
    a.allow(1, {"default"});
    const Value* dflt = a.get(0, "default");
    const J fallback = dflt ? data_of(*dflt) : name == "int" ? J(0) : J(0.0);
    if (v.is_undefined()) undefined_error(v);
    const J& j = v.j();
    if (v.k != Value::K::Data) return Value::data(fallback);
    if (name == "int") {
      if (is_int(j)) return Value::data(int_of(j));
      if (j.is_number_float()) {
        double d = j.get<double>();
        if (!std::isfinite(d) || std::fabs(d) > 9.2e18) return Value::data(fallback);
        return Value::data(int64_t(d));
      }
      if (j.is_string()) {
        std::string t = py_strip(j.get<std::string>(), nullptr, true, true);
        int64_t x = 0;
        auto r = std::from_chars(t.data() + (!t.empty() && t[0] == '+'), t.data() + t.size(), x);
        if (r.ec == std::errc() && r.ptr == t.data() + t.size() && !t.empty()) return Value::data(x);
        char* end = nullptr;
        double d = std::strtod(t.c_str(), &end);
        if (!t.empty() && end == t.c_str() + t.size() && std::isfinite(d) && std::fabs(d) < 9.2e18)
          return Value::data(int64_t(d));
      }
      return Value::data(fallback);
    }
    if (is_num(j)) return Value::data(num_of(j));
    if (j.is_string()) {
      std::string t = py_strip(j.get<std::string>(), nullptr, true, true);
      char* end = nullptr;
      double d = std::strtod(t.c_str(), &end);
      if (!t.empty() && end == t.c_str() + t.size()) return Value::data(d);
    }
    return Value::data(fallback);
  }

  const ChatTemplate::Impl& t_;
  Scope root_;
  std::string out_;
  uint64_t steps_ = 0;
  int call_depth_ = 0;
};

// Jinja reads \r\n and \r as \n, and (keep_trailing_newline off) drops one final newline.
std::string normalize_source(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source) {
  auto impl = std::make_shared<Impl>();
  impl->src.text = normalize_source(source);
  std::vector<Token> toks = Lexer(impl->src).run();
  impl->body = Parser(impl->src, std::move(toks)).parse();
  impl_ = std::move(impl);
}

std::string ChatTemplate::render(const TemplateJson& context) const {
  try {
    return Renderer(*impl_, context).run();
  } catch (const TemplateError&) {
    throw;
  } catch (const Fail& f) {  // from a helper outside any expression
    throw TemplateError(Kind::Render, f.msg, 0, 0);
  } catch (const std::exception& e) {  // nlohmann or the standard library: still the template's error
    throw TemplateError(Kind::Render, e.what(), 0, 0);
  }
}

std::string ChatFormat::render(const TemplateJson& messages) const {
  TemplateJson ctx = special_tokens;
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = true;
  // transformers passes these as None when the request has none; templates test "tools is not none".
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  return tmpl.render(ctx);
}

std::optional<std::string> chat_template_source(const Json& cfg) {
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::vector<std::string> names;
    for (const auto& t : *it) {
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("template") ||
          !t["template"].is_string())
        throw error("chat template",
                    "tokenizer_config.json: chat_template list entries must be {name, template} strings");
      if (t["name"] == "default") return t["template"].get<std::string>();
      names.push_back(t["name"].get<std::string>());
    }
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw error("chat template", "tokenizer_config.json has chat templates named [", list,
                "] but none named \"default\"; pass one with --chat-template FILE");
  }
  throw error("chat template", "tokenizer_config.json: chat_template must be a string or a list of {name, template}");
}

TemplateJson special_tokens_of(const Json& cfg) {
  TemplateJson out = TemplateJson::object();
  auto text = [](const Json& t) -> std::optional<std::string> {
    if (t.is_string()) return t.get<std::string>();
    if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
    return std::nullopt;
  };
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    auto it = cfg.find(k);
    if (it == cfg.end()) continue;
    if (auto s = text(*it)) out[k] = *s;
  }
  if (auto it = cfg.find("additional_special_tokens"); it != cfg.end() && it->is_array()) {
    TemplateJson list = TemplateJson::array();
    for (const auto& t : *it)
      if (auto s = text(t)) list.push_back(*s);
    out["additional_special_tokens"] = list;
  }
  return out;
}

}  // namespace k3::serve
