// A small Jinja2 renderer for the `chat_template` of a Hugging Face tokenizer_config.json, so a
// chat request becomes the exact prompt text the model was trained on (what transformers'
// apply_chat_template produces). The chat formatting around it (which template, which variables)
// is k3 serve's: infer/serve/chat_template.h.
//
// It renders the subset of Jinja that real chat templates use, with the environment transformers
// sets up: trim_blocks and lstrip_blocks on, one trailing newline of the source dropped,
// `raise_exception(msg)`, a `tojson` that keeps key order and non-ASCII text (json.dumps with
// ensure_ascii=False), loop controls (break, continue). Supported:
//   {{ expr }}  {% if / elif / else / endif %}  {% for x in xs [if cond] %} ... {% else %} ... {% endfor %}
//   {% set x = expr %}  {% set ns.attr = expr %}  {% set x %}...{% endset %}  {% macro f(a, b=1) %}
//   {% break %} {% continue %}  {% generation %} (rendered as its body)  {# comments #}  -/+ whitespace control
//   literals (strings with escapes, ints, floats, true/false/none, lists, dicts), x.attr, x[i], x['k'],
//   slices x[a:b:c], calls, a if c else b, + - * / // % ** ~, comparisons, and/or/not, in / not in,
//   tests (is [not] defined/none/string/number/mapping/...), filters (trim, length, tojson, upper,
//   lower, default, join, first, last, items, map, selectattr, ...), string and dict methods
//   (.strip() .split() .startswith() .get() .items() ...), namespace(), range(), strftime_now().
// Not supported (a syntax error that says so): {% raw %}, {% include %}, {% extends %}, blocks,
// {% call %}, {% filter %}, recursive loops, `%` string formatting.
//
// Values are JSON (nlohmann's ordered_json: dicts keep insertion order, as Python's do, which
// `tojson` output depends on). Strings are UTF-8; indexing and length count code points, as
// Python does; upper/lower/title change ASCII letters only.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace k3::serve {

using TemplateJson = nlohmann::ordered_json;

// A template that does not parse (Syntax), fails while rendering (Render: an undefined attribute,
// a type error, a limit), or calls raise_exception (Raised). what() reads
// "[chat template] line L, column C: problem"; message() is the problem alone.
class TemplateError : public Error {
 public:
  enum class Kind { Syntax, Render, Raised };
  TemplateError(Kind kind, const std::string& message, int line, int column);
  Kind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  Kind kind_;
  std::string message_;
  int line_, column_;
};

class ChatTemplate {
 public:
  // Parses the template; throws TemplateError (Kind::Syntax) naming the problem and its position.
  explicit ChatTemplate(const std::string& source);
  // Renders with the variables of `context` (a JSON object). Throws TemplateError. Thread-safe:
  // the parsed template is read-only. Bounded: at most 16 MiB of output and 5 million steps.
  std::string render(const TemplateJson& context) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace k3::serve
