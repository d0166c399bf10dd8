// Python's semantics for the values of a rendering template (jinja_value.h): type names, truth,
// str(), equality and ordering, `in`, iteration, arithmetic with Python's floor division and
// overflow checks, slicing, attribute and item lookup (Jinja's getattr), the `is` tests, tojson,
// and the str and dict methods templates call.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "text/jinja_value.h"

namespace k3::serve::jinja {

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

bool py_eq(const J& a, const J& b, int depth) {
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

namespace {

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

}  // namespace

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

}  // namespace k3::serve::jinja
