// Private to src/text: what the stages of the Jinja engine (text/jinja.h) share. The limits, the
// template source and its positions, Python's string helpers (jinja_strings.cc), the tokens the
// lexer makes (jinja_lexer.cc), the syntax tree the parser builds from them (jinja_parser.cc), and
// the parsed template the renderer walks (jinja_eval.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace k3::serve {
namespace jinja {

using J = TemplateJson;
using Kind = TemplateError::Kind;

// Limits, so that no template or conversation can hang or crash the renderer.
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

// ---------------------------------------------------------------------------------------------
// Strings as Python sees them (jinja_strings.cc): UTF-8 by code point, str methods, str() and
// json.dumps().

std::vector<std::string_view> code_points(std::string_view s);
void append_utf8(std::string& out, uint32_t v);
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right);
std::string ascii_map(std::string s, int (*f)(int));
std::string ascii_title(std::string s);
std::string ascii_capitalize(std::string s);
std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count);
J py_split(const std::string& s, const std::string* sep, int64_t maxsplit);

void check_depth(int depth);  // a Fail past kMaxDataDepth
std::string py_str(const J& j, int depth = 0);

struct DumpOptions {
  int indent = -1;  // -1: one line
  std::string item_sep = ", ", key_sep = ": ";
  bool ensure_ascii = false, sort_keys = false;
};

// Backslash escapes shared by JSON strings (written) and Python string literals (read): the
// character and the letter after the backslash.
constexpr std::pair<char, char> kEscapes[] = {{'"', '"'},  {'\\', '\\'}, {'\n', 'n'}, {'\r', 'r'},
                                              {'\t', 't'}, {'\b', 'b'},   {'\f', 'f'}};

void dump_json(std::string& out, const J& j, const DumpOptions& o, int depth);

// ---------------------------------------------------------------------------------------------
// Tokens (jinja_lexer.cc)

enum class Tok : uint8_t { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok type;
  std::string text;  // Text: the text; Name, Op: the name or operator; String: the decoded value
  size_t pos;
  int64_t i = 0;
  double f = 0;
};

std::vector<Token> lex(const Source& src);

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

// The filter and test names the renderer knows (jinja_parser.cc).
extern const std::set<std::string, std::less<>> kFilters;
extern const std::set<std::string, std::less<>> kTests;

// The template's syntax tree (jinja_parser.cc).
Body parse(const Source& src, std::vector<Token> toks);

}  // namespace jinja

struct ChatTemplate::Impl {
  jinja::Source src;
  jinja::Body body;
};

namespace jinja {

// Renders a parsed template (jinja_eval.cc). Throws TemplateError with a position, or a Fail from a
// helper outside any expression.
std::string render(const ChatTemplate::Impl& t, const J& context);

}  // namespace jinja
}  // namespace k3::serve
