// Private to src/text: a value while a template renders, and Python's semantics for values
// (jinja_value.cc): truth, str(), ==, <, in, arithmetic, slicing, attributes and items, the `is`
// tests, tojson, and the str and dict methods. The renderer (jinja_eval.cc) is built on these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_internal.h"

namespace k3::serve::jinja {

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

const char* type_name(const Value& v);  // Python's name of the value's type: "str", "dict", ...
[[noreturn]] void undefined_error(const Value& v);
const J& data_of(const Value& v);
bool truthy(const Value& v);
std::string to_str(const Value& v);  // str(v)

bool is_num(const J& j);
bool is_int(const J& j);
int64_t int_of(const J& j);
double num_of(const J& j);
bool py_eq(const J& a, const J& b, int depth = 0);
bool compare(const Value& a, const std::string& op, const Value& b);  // == != < > <= >= in, not in

std::vector<Value> iterate(const Value& v);
J to_list(const std::vector<Value>& items);
int64_t length_of(const Value& v);
int64_t int_op(char op, int64_t a, int64_t b);
Value arithmetic(const std::string& op, const Value& a, const Value& b);  // + - * / // % ** ~
std::vector<size_t> slice_indices(int64_t n, const Value* start, const Value* stop, const Value* step);

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

const std::string& str_of(const Value& v, const char* what);
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
bool run_test(const std::string& name, const Value& v, const Args& a);
Value tojson(const Value& v, const Args& a);
Value call_method(const Value& obj, const std::string& name, const Args& a);

}  // namespace k3::serve::jinja
