#include "infer/json_constraint.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"
#include "tokenizer/bpe.h"

namespace k3 {

struct JsonSchema::Node {
  enum class Kind : uint8_t { Any, Object, Array, String, Number, Integer, Literals, Alternatives };
  Kind kind = Kind::Any;
  // Object: closed (only `names`) when the schema lists properties.
  bool closed = false;
  std::vector<std::string> names;
  std::vector<const Node*> props;
  std::vector<bool> required;
  // Array
  const Node* items = nullptr;
  int64_t min_items = 0, max_items = -1;
  // String (characters)
  int64_t min_len = 0, max_len = -1;
  // Literals: their JSON texts (enum, const, booleans, null)
  std::vector<std::string> literals;
  // Alternatives, told apart by a value's first character
  std::vector<const Node*> alts;
  std::string where;  // for messages
};

namespace {

using Node = JsonSchema::Node;
using Kind = Node::Kind;

const std::vector<std::string> kWords = {"true", "false", "null"};

bool is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

// The characters a value of `n` can begin with.
std::set<unsigned char> first_chars(const Node* n, int depth = 0) {
  if (depth > 64) throw error("json_schema", "alternatives that refer to themselves ($ref) before any value begins");
  std::set<unsigned char> s;
  auto number = [&] {
    s.insert('-');
    for (unsigned char c = '0'; c <= '9'; ++c) s.insert(c);
  };
  switch (n->kind) {
    case Kind::Any:
      s = {'{', '[', '"', 't', 'f', 'n'};
      number();
      break;
    case Kind::Object: s.insert('{'); break;
    case Kind::Array: s.insert('['); break;
    case Kind::String: s.insert('"'); break;
    case Kind::Number:
    case Kind::Integer: number(); break;
    case Kind::Literals:
      for (const auto& l : n->literals) s.insert(static_cast<unsigned char>(l[0]));
      break;
    case Kind::Alternatives:
      for (const Node* a : n->alts) {
        auto f = first_chars(a, depth + 1);
        s.insert(f.begin(), f.end());
      }
      break;
  }
  return s;
}

}  // namespace

JsonSchema::JsonSchema() {
  nodes_.push_back(std::make_unique<Node>());
  any_ = nodes_.back().get();
}

JsonSchema::~JsonSchema() = default;

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  std::shared_ptr<JsonSchema> s(new JsonSchema());
  s->nodes_.push_back(std::make_unique<Node>());
  s->nodes_.back()->kind = Kind::Object;
  s->root_ = s->nodes_.back().get();
  return s;
}

std::shared_ptr<const JsonSchema> JsonSchema::compile(const Json& schema) {
  std::shared_ptr<JsonSchema> s(new JsonSchema());
  s->document_ = &schema;
  s->root_ = s->build(schema, "", 0);
  s->document_ = nullptr;
  s->refs_.clear();
  for (const auto& n : s->nodes_) {
    if (n->kind != Kind::Alternatives) continue;
    std::set<unsigned char> seen;
    for (const Node* a : n->alts)
      for (unsigned char c : first_chars(a))
        if (!seen.insert(c).second)
          throw error("json_schema", n->where, ": alternatives that can both begin with '", std::string(1, char(c)),
                      "' are not supported (each must begin differently: object, array, string, number, ...)");
  }
  return s;
}

const JsonSchema::Node* JsonSchema::build(const Json& s, const std::string& where, int depth) {
  const std::string at = where.empty() ? "the schema" : where;
  if (depth > 32) throw error("json_schema", at, " nests more than 32 levels");
  if (s.is_boolean() && s.get<bool>()) return any_;
  if (!s.is_object()) throw error("json_schema", at, " is not a schema object");
  static const std::set<std::string> annotations = {"title", "description", "default", "examples", "$schema", "$id",
                                                    "$comment", "$defs", "definitions"};
  static const std::set<std::string> supported = {"type",     "properties", "required", "additionalProperties",
                                                  "items",    "minItems",   "maxItems", "enum",
                                                  "const",    "anyOf",      "minLength", "maxLength", "$ref"};
  for (const auto& [k, v] : s.items())
    if (!annotations.count(k) && !supported.count(k))
      throw error("json_schema", at, ": the keyword '", k,
                  "' is not supported (type, properties, required, additionalProperties: false, items, minItems, "
                  "maxItems, enum, const, anyOf, minLength, maxLength, $ref to $defs)");
  auto count = [&](const char* key, int64_t fallback) -> int64_t {
    if (!s.contains(key)) return fallback;
    const Json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      throw error("json_schema", at, ": '", key, "' must be a non-negative integer");
    return v.get<int64_t>();
  };
  auto node = [&]() {
    nodes_.push_back(std::make_unique<Node>());
    return nodes_.back().get();
  };
  auto literals = [&](std::vector<Json> values, const char* key) {
    if (values.empty()) throw error("json_schema", at, ": '", key, "' lists no values");
    Node* n = node();
    n->kind = Kind::Literals;
    for (const Json& v : values) {
      if (v.is_object() || v.is_array())
        throw error("json_schema", at, ": '", key, "' values must be strings, numbers, booleans or null");
      n->literals.push_back(v.dump());
    }
    return n;
  };
  if (s.contains("$ref")) {
    if (s.size() > 1 + size_t(s.contains("description")) + size_t(s.contains("title")))
      throw error("json_schema", at, ": keywords beside '$ref' are not supported");
    if (!s["$ref"].is_string()) throw error("json_schema", at, ": '$ref' must be a string");
    return resolve(s["$ref"].get<std::string>(), at, depth);
  }
  if (s.contains("const")) return literals({s["const"]}, "const");
  if (s.contains("enum")) {
    if (!s["enum"].is_array()) throw error("json_schema", at, ": 'enum' must be an array");
    return literals(std::vector<Json>(s["enum"].begin(), s["enum"].end()), "enum");
  }
  auto alternatives = [&](std::vector<const Node*> alts) {  // checked once every $ref is built
    Node* n = node();
    n->kind = Kind::Alternatives;
    n->alts = std::move(alts);
    n->where = at;
    return n;
  };
  if (s.contains("anyOf")) {
    const Json& a = s["anyOf"];
    if (!a.is_array() || a.empty()) throw error("json_schema", at, ": 'anyOf' must be a non-empty array");
    std::vector<const Node*> alts;
    for (size_t i = 0; i < a.size(); ++i) alts.push_back(build(a[i], at + "/anyOf/" + std::to_string(i), depth + 1));
    return alternatives(std::move(alts));
  }
  std::string type;
  if (s.contains("type")) {
    const Json& t = s["type"];
    if (t.is_array()) {
      std::vector<const Node*> alts;
      for (const Json& one : t) {
        Json copy = s;
        copy["type"] = one;
        alts.push_back(build(copy, where, depth + 1));
      }
      if (alts.empty()) throw error("json_schema", at, ": 'type' lists no types");
      return alternatives(std::move(alts));
    }
    if (!t.is_string()) throw error("json_schema", at, ": 'type' must be a string or an array of strings");
    type = t.get<std::string>();
  } else if (s.contains("properties")) {
    type = "object";
  } else if (s.contains("items")) {
    type = "array";
  } else {
    return any_;
  }
  Node* n = node();
  if (type == "object") {
    n->kind = Kind::Object;
    if (s.contains("additionalProperties")) {
      const Json& ap = s["additionalProperties"];
      const bool open = !(ap.is_boolean() && !ap.get<bool>());
      if (open && s.contains("properties"))
        throw error("json_schema", at, ": properties with additionalProperties other than false are not supported");
    }
    if (s.contains("properties")) {
      const Json& ps = s["properties"];
      if (!ps.is_object()) throw error("json_schema", at, ": 'properties' must be an object");
      n->closed = true;
      for (const auto& [name, sub] : ps.items()) {
        if (name.empty() || name.find_first_of("\"\\") != std::string::npos ||
            std::any_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; }))
          throw error("json_schema", at, ": property name '", name, "' needs escaping, which is not supported");
        n->names.push_back(name);
        n->props.push_back(build(sub, at + "/properties/" + name, depth + 1));
        n->required.push_back(false);
      }
      if (n->names.empty()) n->closed = false;
    }
    if (s.contains("required")) {
      const Json& r = s["required"];
      if (!r.is_array()) throw error("json_schema", at, ": 'required' must be an array");
      for (const Json& name : r) {
        auto it = name.is_string() ? std::find(n->names.begin(), n->names.end(), name.get<std::string>()) : n->names.end();
        if (it == n->names.end())
          throw error("json_schema", at, ": required property ", name.dump(), " is not among the properties");
        n->required[size_t(it - n->names.begin())] = true;
      }
    }
  } else if (type == "array") {
    n->kind = Kind::Array;
    n->items = s.contains("items") ? build(s["items"], at + "/items", depth + 1) : any_;
    n->min_items = count("minItems", 0);
    n->max_items = count("maxItems", -1);
    if (n->max_items >= 0 && n->max_items < n->min_items)
      throw error("json_schema", at, ": maxItems is below minItems");
  } else if (type == "string") {
    n->kind = Kind::String;
    n->min_len = count("minLength", 0);
    n->max_len = count("maxLength", -1);
    if (n->max_len >= 0 && n->max_len < n->min_len) throw error("json_schema", at, ": maxLength is below minLength");
  } else if (type == "number" || type == "integer") {
    n->kind = type == "number" ? Kind::Number : Kind::Integer;
  } else if (type == "boolean") {
    n->kind = Kind::Literals;
    n->literals = {"true", "false"};
  } else if (type == "null") {
    n->kind = Kind::Literals;
    n->literals = {"null"};
  } else {
    throw error("json_schema", at, ": unknown type '", type, "'");
  }
  return n;
}

const JsonSchema::Node* JsonSchema::resolve(const std::string& ref, const std::string& where, int depth) {
  if (auto it = refs_.find(ref); it != refs_.end()) return it->second;  // a recursive schema points back
  const Json* target = nullptr;
  for (const char* base : {"#/$defs/", "#/definitions/"}) {
    const std::string b = base;
    if (ref.rfind(b, 0) != 0) continue;
    const std::string name = ref.substr(b.size());
    const std::string key = b.substr(2, b.size() - 3);  // $defs or definitions
    if (!document_->contains(key)) continue;
    const Json& defs = document_->at(key);
    if (defs.is_object() && defs.contains(name)) target = &defs.at(name);
  }
  if (!target)
    throw error("json_schema", where, ": '$ref' ", ref, " does not name an entry of the schema's $defs or definitions");
  // The node exists before its contents are built, so references inside it come back to it.
  nodes_.push_back(std::make_unique<Node>());
  Node* n = nodes_.back().get();
  refs_[ref] = n;
  const Node* built = build(*target, ref.substr(1), depth + 1);
  if (built != n) *n = *built;
  return n;
}

// ---- the recognizer ----

struct JsonMatcher::Frame {
  enum class K : uint8_t { Value, Object, Array, String, Number, Literal };
  K k = K::Value;
  const Node* node = nullptr;
  uint8_t st = 0;
  int8_t utf8 = 0, esc = 0;  // String: continuation bytes due; 1 after '\\', 2..5 in a \u escape
  uint8_t lo = 0x80, hi = 0xBF;  // String: the range of the next continuation byte (valid UTF-8)
  int8_t exp_digits = 0;     // Number
  bool integer = false;      // Number
  int64_t count = 0;         // Array: items; String: characters; Number: characters
  std::string buf;           // Literal or a closed object's key: the characters so far
  std::vector<bool> seen;    // Object: the properties given
  const Node* pending = nullptr;  // Object: the schema of the value after the key
  const std::vector<std::string>* cands = nullptr;  // Literal
};

namespace {
// Object states
enum : uint8_t { kOpen, kKey, kKeyString, kColon, kValue, kAfter, kNext };
// Number states; accepting: kZero, kInt, kFrac, kExp
enum : uint8_t { kStart, kMinus, kZero, kInt, kDot, kFrac, kE, kESign, kExp };
constexpr int64_t kMaxNumber = 32, kMaxIntegerDigits = 18, kMaxExponentDigits = 2, kMaxWhitespace = 16;

bool number_accepting(uint8_t st) { return st == kZero || st == kInt || st == kFrac || st == kExp; }

bool object_may_close(const JsonMatcher::Frame& f) {
  if (!f.node->closed) return true;
  for (size_t i = 0; i < f.seen.size(); ++i)
    if (f.node->required[i] && !f.seen[i]) return false;
  return true;
}

bool object_has_unseen(const JsonMatcher::Frame& f) {
  return !f.node->closed || std::find(f.seen.begin(), f.seen.end(), false) != f.seen.end();
}

bool literal_is_whole(const JsonMatcher::Frame& f) {
  return std::find(f.cands->begin(), f.cands->end(), f.buf) != f.cands->end();
}
}  // namespace

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonSchema> schema) : schema_(std::move(schema)) {
  Frame root;
  root.node = schema_->root();
  stack_.push_back(std::move(root));
}
JsonMatcher::JsonMatcher(const JsonMatcher&) = default;
JsonMatcher& JsonMatcher::operator=(const JsonMatcher&) = default;
JsonMatcher::~JsonMatcher() = default;

bool JsonMatcher::done() const {
  if (finished_) return true;
  if (stack_.size() != 1) return false;
  const Frame& f = stack_.back();
  if (f.k == Frame::K::Number) return number_accepting(f.st);
  if (f.k == Frame::K::Literal) return literal_is_whole(f);
  return false;
}

bool JsonMatcher::in_free_string() const {
  if (stack_.empty()) return false;
  const Frame& f = stack_.back();
  return f.k == Frame::K::String && f.esc == 0 && f.utf8 == 0 && (!f.node || f.node->max_len < 0);
}

bool JsonMatcher::feed(std::string_view bytes) {
  JsonMatcher saved = *this;
  if (feed_raw(bytes)) return true;
  *this = std::move(saved);
  return false;
}

bool JsonMatcher::feed_raw(std::string_view bytes) {
  for (char c : bytes)
    if (!step(static_cast<unsigned char>(c))) return false;
  return true;
}

bool JsonMatcher::structural_ws(unsigned char c) {
  // Spaces, tabs and one line break per run: pretty-printed JSON, without runs of blank lines.
  if (!is_ws(c) || c == '\r' || ws_run_ >= kMaxWhitespace || (c == '\n' && ws_newline_)) return false;
  ++ws_run_;
  if (c == '\n') ws_newline_ = true;
  return true;
}

void JsonMatcher::end_ws() {
  ws_run_ = 0;
  ws_newline_ = false;
}

void JsonMatcher::pop() {
  stack_.pop_back();
  if (stack_.empty()) {
    finished_ = true;
    return;
  }
  Frame& p = stack_.back();
  if (p.k == Frame::K::Object) p.st = p.st == kKeyString ? kColon : kAfter;
  if (p.k == Frame::K::Array) p.st = 1;  // after an item
}

bool JsonMatcher::step(unsigned char c) {
  for (;;) {  // a frame that ends on a character that is not its own hands it to its parent
    if (finished_) return structural_ws(c);
    Frame& f = stack_.back();
    const bool ws = is_ws(c);
    switch (f.k) {
      case Frame::K::Value: {
        if (ws) return structural_ws(c);
        const Node* n = f.node;
        if (n->kind == Kind::Alternatives) {
          const Node* pick = nullptr;
          for (const Node* a : n->alts)
            if (first_chars(a).count(c)) pick = a;
          if (!pick) return false;
          f.node = pick;
          continue;
        }
        const bool any = n->kind == Kind::Any;
        if (c == '{' && (any || n->kind == Kind::Object)) {
          f.k = Frame::K::Object;
          f.node = any ? schema_->any() : n;
          f.st = kOpen;
          f.seen.assign(f.node->names.size(), false);
          end_ws();
          return true;
        }
        if (c == '[' && (any || n->kind == Kind::Array)) {
          f.k = Frame::K::Array;
          f.st = 0;
          f.count = 0;
          end_ws();
          return true;
        }
        if (c == '"' && (any || n->kind == Kind::String)) {
          f.k = Frame::K::String;
          f.node = any ? nullptr : n;
          f.count = 0;
          end_ws();
          return true;
        }
        if ((c == '-' || is_digit(c)) && (any || n->kind == Kind::Number || n->kind == Kind::Integer)) {
          f.k = Frame::K::Number;
          f.integer = n->kind == Kind::Integer;
          f.st = kStart;
          f.exp_digits = 0;
          f.buf.clear();
          f.count = 0;
          continue;
        }
        const std::vector<std::string>* cands = any ? &kWords : n->kind == Kind::Literals ? &n->literals : nullptr;
        if (!cands) return false;
        if (std::none_of(cands->begin(), cands->end(), [&](const std::string& l) { return (unsigned char)l[0] == c; }))
          return false;
        f.k = Frame::K::Literal;
        f.cands = cands;
        f.buf.clear();
        continue;
      }
      case Frame::K::Object: {
        const Node* n = f.node;
        switch (f.st) {
          case kOpen:
          case kNext:
            if (ws) return structural_ws(c);
            if (c == '}' && f.st == kOpen && object_may_close(f)) break;
            if (c != '"' || !object_has_unseen(f)) return false;
            end_ws();
            if (n->closed) {
              f.st = kKey;
              f.buf.clear();
            } else {
              f.st = kKeyString;
              f.pending = schema_->any();
              Frame key;
              key.k = Frame::K::String;
              stack_.push_back(std::move(key));
            }
            return true;
          case kKey: {
            if (c == '"') {
              for (size_t i = 0; i < n->names.size(); ++i)
                if (!f.seen[i] && n->names[i] == f.buf) {
                  f.seen[i] = true;
                  f.pending = n->props[i];
                  f.st = kColon;
                  return true;
                }
              return false;
            }
            f.buf.push_back(char(c));
            for (size_t i = 0; i < n->names.size(); ++i)
              if (!f.seen[i] && n->names[i].compare(0, f.buf.size(), f.buf) == 0) return true;
            f.buf.pop_back();
            return false;
          }
          case kColon: {
            if (ws) return structural_ws(c);
            if (c != ':') return false;
            end_ws();
            f.st = kValue;
            Frame v;
            v.node = f.pending;
            stack_.push_back(std::move(v));
            return true;
          }
          case kAfter:
            if (ws) return structural_ws(c);
            if (c == ',' && object_has_unseen(f)) {
              end_ws();
              f.st = kNext;
              return true;
            }
            if (c == '}' && object_may_close(f)) break;
            return false;
          default:
            return false;
        }
        end_ws();  // '}'
        pop();
        return true;
      }
      case Frame::K::Array: {
        const Node* items = f.node->kind == Kind::Array ? f.node->items : schema_->any();
        const int64_t min = f.node->kind == Kind::Array ? f.node->min_items : 0;
        const int64_t max = f.node->kind == Kind::Array ? f.node->max_items : -1;
        if (ws) return structural_ws(c);
        if (f.st == 1) {  // after an item
          if (c == ',' && (max < 0 || f.count < max)) {
            end_ws();
            f.st = 2;
            return true;
          }
          if (c == ']' && f.count >= min) {
            end_ws();
            pop();
            return true;
          }
          return false;
        }
        if (c == ']' && f.st == 0 && min == 0) {
          end_ws();
          pop();
          return true;
        }
        if (max == 0) return false;
        f.count++;
        Frame v;
        v.node = items;
        stack_.push_back(std::move(v));
        continue;  // the item's first character
      }
      case Frame::K::String: {
        const int64_t min = f.node ? f.node->min_len : 0, max = f.node ? f.node->max_len : -1;
        end_ws();
        if (f.utf8 > 0) {
          if (c < f.lo || c > f.hi) return false;
          f.utf8--;
          f.lo = 0x80, f.hi = 0xBF;
          return true;
        }
        if (f.esc == 1) {
          if (c == 'u') {
            f.esc = 2;
            return true;
          }
          if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n' && c != 'r' && c != 't') return false;
          f.esc = 0;
          return true;
        }
        if (f.esc >= 2) {
          if (!std::isxdigit(c)) return false;
          f.esc = f.esc == 5 ? 0 : int8_t(f.esc + 1);
          return true;
        }
        if (c == '"') {
          if (f.count < min) return false;
          pop();
          return true;
        }
        if (c < 0x20 || (max >= 0 && f.count >= max)) return false;
        if (c >= 0x80) {  // no overlong forms, surrogates or code points past U+10FFFF
          if (c >= 0xC2 && c <= 0xDF) f.utf8 = 1;
          else if (c >= 0xE0 && c <= 0xEF) f.utf8 = 2;
          else if (c >= 0xF0 && c <= 0xF4) f.utf8 = 3;
          else return false;
          f.lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
          f.hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
        }
        if (c == '\\') f.esc = 1;
        f.count++;
        return true;
      }
      case Frame::K::Number: {
        uint8_t next = 255;
        switch (f.st) {
          case kStart: next = c == '-' ? kMinus : c == '0' ? kZero : is_digit(c) ? kInt : 255; break;
          case kMinus: next = c == '0' ? kZero : is_digit(c) ? kInt : 255; break;
          case kZero: next = (c == '.' && !f.integer) ? kDot : ((c == 'e' || c == 'E') && !f.integer) ? kE : 255; break;
          case kInt:
            next = is_digit(c) ? kInt : (c == '.' && !f.integer) ? kDot : ((c == 'e' || c == 'E') && !f.integer) ? kE : 255;
            break;
          case kDot: next = is_digit(c) ? kFrac : 255; break;
          case kFrac: next = is_digit(c) ? kFrac : (c == 'e' || c == 'E') ? kE : 255; break;
          case kE: next = (c == '+' || c == '-') ? kESign : is_digit(c) ? kExp : 255; break;
          case kESign:
          case kExp: next = is_digit(c) ? kExp : 255; break;
        }
        if (next != 255) {
          const int64_t digits = f.count - (f.buf == "-" ? 1 : 0);
          if (f.count >= kMaxNumber || (f.integer && is_digit(c) && digits >= kMaxIntegerDigits)) return false;
          if (next == kExp && f.exp_digits++ >= kMaxExponentDigits) return false;
          if (c == '-' && f.st == kStart) f.buf = "-";
          f.st = next;
          f.count++;
          end_ws();
          return true;
        }
        if (!number_accepting(f.st)) return false;
        pop();
        continue;  // the character after the number is its parent's
      }
      case Frame::K::Literal: {
        f.buf.push_back(char(c));
        const bool prefix = std::any_of(f.cands->begin(), f.cands->end(),
                                        [&](const std::string& l) { return l.compare(0, f.buf.size(), f.buf) == 0; });
        if (prefix) {
          end_ws();
          // Whole and not the start of a longer one: done now.
          const bool longer = std::any_of(f.cands->begin(), f.cands->end(), [&](const std::string& l) {
            return l.size() > f.buf.size() && l.compare(0, f.buf.size(), f.buf) == 0;
          });
          if (literal_is_whole(f) && !longer) pop();
          return true;
        }
        f.buf.pop_back();
        if (!literal_is_whole(f)) return false;
        pop();
        continue;
      }
    }
  }
}

// ---- token masks ----

std::shared_ptr<const TokenBytes> TokenBytes::of(std::vector<std::string> bytes) {
  auto t = std::make_shared<TokenBytes>();
  t->plain.resize(bytes.size());
  t->first.resize(bytes.size());
  t->second.resize(bytes.size());
  t->size.resize(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    t->size[i] = uint8_t(std::min<size_t>(bytes[i].size(), 255));
    t->first[i] = bytes[i].empty() ? 0 : static_cast<uint8_t>(bytes[i][0]);
    t->second[i] = bytes[i].size() < 2 ? 0 : static_cast<uint8_t>(bytes[i][1]);
  }
  for (size_t i = 0; i < bytes.size(); ++i)
    t->plain[i] = !bytes[i].empty() && std::all_of(bytes[i].begin(), bytes[i].end(), [](char ch) {
      const auto c = static_cast<unsigned char>(ch);
      return c >= 0x20 && c < 0x7F && c != '"' && c != '\\';
    });
  t->bytes = std::move(bytes);
  return t;
}

std::shared_ptr<const TokenBytes> TokenBytes::of(const Tokenizer& tok) {
  std::vector<std::string> bytes(static_cast<size_t>(tok.vocab_size()));
  std::vector<bool> special(bytes.size(), false);
  for (const auto& s : tok.specials())
    if (s.id >= 0 && size_t(s.id) < special.size()) special[size_t(s.id)] = true;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (special[i]) continue;
    try {
      bytes[i] = tok.token_bytes(int32_t(i));
    } catch (const Error&) {  // a hole in the ids: never allowed
    }
  }
  return of(std::move(bytes));
}

JsonConstraint::JsonConstraint(std::shared_ptr<const JsonSchema> schema, std::shared_ptr<const TokenBytes> vocab)
    : m_(std::move(schema)), vocab_(std::move(vocab)) {}

int64_t JsonConstraint::mask(float* logits, int64_t V) const {
  const float ninf = -std::numeric_limits<float>::infinity();
  // Which first two bytes can come next: a token starting otherwise needs no closer look. Every
  // first byte is tried; a pair is tried when a token first needs it, from the state after its
  // first byte.
  thread_local std::vector<uint8_t> pair;  // [first][0]: the first byte alone; [first][1 + second]
  pair.assign(256 * 257, 0);               // 0: not tried, 1: no, 2: yes
  std::array<std::unique_ptr<JsonMatcher>, 256> after;
  JsonMatcher probe = m_;
  for (int a = 0; a < 256; ++a) {
    probe = m_;
    pair[size_t(a) * 257] = probe.step(static_cast<unsigned char>(a)) ? 2 : 1;
  }
  auto second_ok = [&](unsigned char a, unsigned char b) {
    uint8_t& known = pair[size_t(a) * 257 + 1 + b];
    if (known == 0) {
      if (!after[a]) {
        after[a] = std::make_unique<JsonMatcher>(m_);
        after[a]->step(a);
      }
      probe = *after[a];
      known = probe.step(b) ? 2 : 1;
    }
    return known == 2;
  };
  const bool free_string = m_.in_free_string();
  int64_t allowed = 0;
  const int64_t n = std::min<int64_t>(V, int64_t(vocab_->bytes.size()));
  JsonMatcher& scratch = probe;
  const uint8_t *first = vocab_->first.data(), *second = vocab_->second.data(), *size = vocab_->size.data();
  const uint8_t* plain = vocab_->plain.data();
  for (int64_t id = 0; id < n; ++id) {
    bool ok;
    if (size[id] == 0 || pair[size_t(first[id]) * 257] != 2) {
      ok = false;
    } else if (size[id] == 1 || (free_string && plain[id])) {
      ok = true;
    } else if (!second_ok(first[id], second[id])) {
      ok = false;
    } else if (size[id] == 2) {
      ok = true;
    } else {
      scratch = m_;
      ok = scratch.feed_raw(vocab_->bytes[size_t(id)]);
    }
    if (ok) ++allowed;
    else logits[id] = ninf;
  }
  for (int64_t id = n; id < V; ++id) logits[id] = ninf;  // ids past the tokenizer's vocabulary
  return allowed;
}

void JsonConstraint::accept(int64_t id) {
  if (id < 0 || id >= int64_t(vocab_->bytes.size()) || vocab_->bytes[size_t(id)].empty() ||
      !m_.feed(vocab_->bytes[size_t(id)]))
    throw error("json", "token ", id, " does not continue the JSON document");
}

}  // namespace k3
