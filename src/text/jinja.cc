// The Jinja engine of text/jinja.h in three stages: a lexer (jinja_lexer.cc: Jinja's whitespace
// rules live there), a recursive-descent parser to a small syntax tree (jinja_parser.cc: syntax
// errors, with positions), and a tree-walking renderer over JSON values with Python's semantics
// (jinja_eval.cc, jinja_value.cc, jinja_strings.cc). Here: TemplateError, and ChatTemplate's
// entry points that run the stages.
#include "text/jinja.h"

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_internal.h"

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
  std::vector<jinja::Token> toks = jinja::lex(impl->src);
  impl->body = jinja::parse(impl->src, std::move(toks));
  impl_ = std::move(impl);
}

std::string ChatTemplate::render(const TemplateJson& context) const {
  try {
    return jinja::render(*impl_, context);
  } catch (const TemplateError&) {
    throw;
  } catch (const jinja::Fail& f) {  // from a helper outside any expression
    throw TemplateError(TemplateError::Kind::Render, f.msg, 0, 0);
  } catch (const std::exception& e) {  // nlohmann or the standard library: still the template's error
    throw TemplateError(TemplateError::Kind::Render, e.what(), 0, 0);
  }
}

}  // namespace k3::serve
