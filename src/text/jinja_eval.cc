// The Jinja engine's renderer: walks the syntax tree over JSON values (jinja_value.h) with
// Python's semantics, running statements, expressions, calls, macros, builtins and filters,
// bounded in steps, output and depth so that no template or conversation can hang or crash it.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace k3::serve::jinja {

// ---------------------------------------------------------------------------------------------
// Evaluation

namespace {

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

}  // namespace

std::string render(const ChatTemplate::Impl& t, const J& context) { return Renderer(t, context).run(); }

}  // namespace k3::serve::jinja
