// The Jinja engine's parser: tokens into the syntax tree of jinja_internal.h, by recursive descent,
// with syntax errors that say what was expected and where (and where an unclosed block opened).
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_internal.h"

namespace k3::serve::jinja {

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

namespace {

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

Body parse(const Source& src, std::vector<Token> toks) { return Parser(src, std::move(toks)).parse(); }

}  // namespace k3::serve::jinja
