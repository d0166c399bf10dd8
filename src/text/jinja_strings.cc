// Strings with Python's semantics for the Jinja engine: UTF-8 by code point (as Python indexes
// str), the str methods templates call (strip, split, replace, title, ...), and Python's text
// forms of values: str(), repr() and json.dumps() (what {{ x }} and |tojson print).
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_internal.h"

namespace k3::serve::jinja {

// ---------------------------------------------------------------------------------------------
// UTF-8: Python strings index by code point, so k3 does too.

namespace {

uint32_t decode(std::string_view cp) {
  uint8_t c = uint8_t(cp[0]);
  if (cp.size() == 1) return c;
  uint32_t v = c & (0xFF >> (cp.size() + 1));
  for (size_t k = 1; k < cp.size(); ++k) v = (v << 6) | (uint8_t(cp[k]) & 0x3F);
  return v;
}

// Python's str.isspace() set.
bool is_py_space(uint32_t v) {
  return (v >= 0x09 && v <= 0x0D) || (v >= 0x1C && v <= 0x20) || v == 0x85 || v == 0xA0 || v == 0x1680 ||
         (v >= 0x2000 && v <= 0x200A) || v == 0x2028 || v == 0x2029 || v == 0x202F || v == 0x205F || v == 0x3000;
}

}  // namespace

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

namespace {

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

std::string py_repr(const J& j, int depth) {
  return j.is_string() ? py_repr_str(j.get_ref<const std::string&>()) : py_str(j, depth);
}

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

}  // namespace

void check_depth(int depth) {
  if (depth > kMaxDataDepth) throw Fail{"a value nests deeper than " + std::to_string(kMaxDataDepth) + " levels"};
}

// str(value) as Python prints it ({{ x }}, ~, |string).
std::string py_str(const J& j, int depth) {
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

}  // namespace k3::serve::jinja
