// The Jinja engine (text/jinja.h) against the exact text Python's jinja2 renders
// (tests/data/chat_templates/*.json, written by tools/make_chat_template_goldens.py with
// transformers' settings), and its errors (syntax, rendering, raise_exception, limits). The chat
// formatting around it for k3 serve is tested in src/infer/serve_chat_template_test.cc.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "text/jinja.h"
#include "text/testing.h"

namespace k3::serve {
namespace {

using testing::read_golden;

TemplateError render_error(const std::string& source, const TemplateJson& ctx = TemplateJson::object()) {
  try {
    ChatTemplate(source).render(ctx);
  } catch (const TemplateError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for: " << source;
  return TemplateError(TemplateError::Kind::Render, "", 0, 0);
}

std::string render(const std::string& source, const TemplateJson& ctx = TemplateJson::object()) {
  return ChatTemplate(source).render(ctx);
}

// Every template and context of one golden file renders to jinja2's text, or raises its message.
void check_golden_file(const std::string& name) {
  TemplateJson doc = read_golden(name);
  ASSERT_TRUE(doc.contains("template")) << name;
  ChatTemplate tmpl(doc["template"].get<std::string>());
  ASSERT_FALSE(doc["cases"].empty());
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(name + " / " + c["name"].get<std::string>());
    if (c.contains("expected")) {
      EXPECT_EQ(tmpl.render(c["context"]), c["expected"].get<std::string>());
    } else {
      try {
        tmpl.render(c["context"]);
        ADD_FAILURE() << "expected raise_exception(" << c["raises"] << ")";
      } catch (const TemplateError& e) {
        EXPECT_EQ(e.kind(), TemplateError::Kind::Raised) << e.what();
        EXPECT_EQ(e.message(), c["raises"].get<std::string>());
      }
    }
  }
}

TEST(ChatTemplateGolden, ChatML) { check_golden_file("chatml.json"); }
TEST(ChatTemplateGolden, KimiStyleWithMacro) { check_golden_file("kimi.json"); }
TEST(ChatTemplateGolden, Llama3) { check_golden_file("llama3.json"); }
TEST(ChatTemplateGolden, AlternatingRolesRaise) { check_golden_file("alternating.json"); }
TEST(ChatTemplateGolden, TrimAndLstripBlocks) { check_golden_file("whitespace.json"); }
TEST(ChatTemplateGolden, Expressions) { check_golden_file("expressions.json"); }
TEST(ChatTemplateGolden, ToolsAndTojson) { check_golden_file("tools.json"); }

// Templates jinja2 refuses: k3 refuses them too, saying what is wrong and where.
TEST(ChatTemplateErrors, SyntaxErrorsJinjaAlsoRejects) {
  TemplateJson doc = read_golden("errors.json");
  ASSERT_GE(doc["cases"].size(), 8u);
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>() + ": " + c["template"].get<std::string>());
    try {
      ChatTemplate t(c["template"].get<std::string>());
      ADD_FAILURE() << "parsed; jinja2 says: " << c["jinja2_error"];
    } catch (const TemplateError& e) {
      EXPECT_EQ(e.kind(), TemplateError::Kind::Syntax);
      EXPECT_NE(std::string(e.what()).find(c["k3_message_contains"].get<std::string>()), std::string::npos) << e.what();
      EXPECT_GE(e.line(), 1);
      EXPECT_NE(std::string(e.what()).find("line "), std::string::npos) << e.what();
    }
  }
}

// The error `source` raises (rendered with ctx) is of `kind` and its message contains `says`.
TemplateError expect_error(const std::string& source, TemplateError::Kind kind, const std::string& says,
                           const TemplateJson& ctx = TemplateJson::object()) {
  TemplateError e = render_error(source, ctx);
  EXPECT_EQ(int(e.kind()), int(kind)) << source << " -> " << e.what();
  EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << source << " -> " << e.what();
  return e;
}

TEST(ChatTemplateErrors, PositionsAndMessages) {
  using K = TemplateError::Kind;
  TemplateError e = expect_error("line one\n  {{ messages | nosuch }}", K::Syntax, "unknown filter 'nosuch'");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 17);  // the filter name
  EXPECT_STREQ(e.what(), "[chat template] line 2, column 17: unknown filter 'nosuch'");
  expect_error("a\nb {% if x %}\n{{ y }}", K::Syntax,
               "the '{% if %}' at line 2, column 3 is never closed with '{% endif %}'");
  expect_error("{{ 'abc' }", K::Syntax, "unexpected '}'");
  expect_error("{% for m in messages %}{{ m }}", K::Syntax, "never closed");
  expect_error("{% break %}", K::Syntax, "outside a for loop");
  expect_error("{% include 'x' %}", K::Syntax, "not supported");
  expect_error("{{ x is frobbed }}", K::Syntax, "unknown test 'frobbed'");
}

TEST(ChatTemplateErrors, RenderErrorsNameTheProblem) {
  using K = TemplateError::Kind;
  // An attribute of an undefined variable is an error (plain undefined prints as "").
  EXPECT_EQ(render("[{{ nothing }}]"), "[]");
  expect_error("{{ nothing.role }}", K::Render, "'nothing' is undefined");
  EXPECT_EQ(expect_error("\n{{ 1 + 'a' }}", K::Render, "unsupported operand types for +: 'int' and 'str'").line(), 2);
  expect_error("{{ messages[0].content.shout() }}", K::Render, "no method 'shout'",
               TemplateJson{{"messages", TemplateJson::array({{{"role", "user"}, {"content", "x"}}})}});
  TemplateError e = expect_error("{{ raise_exception('Only user and assistant roles are supported') }}", K::Raised,
                                 "Only user and assistant roles are supported");
  EXPECT_EQ(e.message(), "Only user and assistant roles are supported");
  expect_error("{% set x = 1 %}{% set x.y = 2 %}", K::Render, "namespace()");
  expect_error("{{ 1 // 0 }}", K::Render, "division by zero");
  expect_error("{{ 9223372036854775807 + 1 }}", K::Render, "overflow");
  expect_error("x", K::Render, "the context must be a JSON object", TemplateJson::array());
}

TEST(ChatTemplateErrors, LimitsStopRunawayTemplates) {
  using K = TemplateError::Kind;
  // Endless work and huge output end in an error, not a hang or an out-of-memory.
  expect_error("{% for i in range(100000000) %}{% endfor %}", K::Render, "range()");
  expect_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", K::Render, "steps");
  expect_error("{% for i in range(100000) %}{% for j in range(10) %}{{ 'x' * 40 }}{% endfor %}{% endfor %}", K::Render,
               "MiB");
  expect_error("{{ ([0] * 100000000)|length }}", K::Render, "too long");
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", K::Render, "nest deeper");
  expect_error("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}", K::Syntax, "nests deeper");
}

// Odd inputs never crash: every prefix of a real template either parses or throws TemplateError.
TEST(ChatTemplateErrors, EveryPrefixOfATemplateFailsCleanly) {
  TemplateJson doc = read_golden("tools.json");
  const std::string src = doc["template"].get<std::string>();
  const TemplateJson& ctx = doc["cases"][0]["context"];
  for (size_t n = 0; n <= src.size(); n += 3) {
    try {
      ChatTemplate(src.substr(0, n)).render(ctx);
    } catch (const TemplateError&) {
    }
  }
}

TEST(ChatTemplate, WhitespaceControlAndNewlines) {
  // "-" strips, trim_blocks eats one newline after a block tag, lstrip_blocks the indent before it.
  EXPECT_EQ(render("a  {{- 'b' -}}  c"), "abc");
  EXPECT_EQ(render("{% if true %}\nx\n{% endif %}\ny"), "x\ny");
  EXPECT_EQ(render("    {% if true %}x{% endif %}"), "x");
  EXPECT_EQ(render("    {%+ if true %}x{% endif +%}\n"), "    x");  // + keeps both; the last newline is dropped
  EXPECT_EQ(render("a\r\nb\rc\n"), "a\nb\nc");                      // newlines normalised, one final one dropped
  EXPECT_EQ(render("  {# c #}\nz"), "z");
  EXPECT_EQ(render("{{ 'x' }}\n"), "x");
}

TEST(ChatTemplate, ValuesPrintAsPythonDoes) {
  TemplateJson ctx = {{"f", 0.5}, {"big", 1e20}, {"n", nullptr}, {"b", true}, {"l", {1, "a", nullptr}},
                      {"d", {{"k", "v"}}}};
  EXPECT_EQ(render("{{ f }} {{ big }} {{ n }} {{ b }} {{ l }} {{ d }} {{ 1e-5 }} {{ 2.0 }}", ctx),
            "0.5 1e+20 None True [1, 'a', None] {'k': 'v'} 1e-05 2.0");
  EXPECT_EQ(render("{{ d|tojson }} {{ 'é'|tojson }} {{ 'é'|tojson(ensure_ascii=true) }}", ctx),
            "{\"k\": \"v\"} \"é\" \"\\u00e9\"");
  EXPECT_EQ(render("{{ 'héllo'[1] }}{{ 'héllo'|length }}{{ 'héllo'[-3:] }}"), "é5llo");
}

TEST(ChatTemplate, SetInsideLoopDoesNotLeakButNamespaceDoes) {
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = i %}{% endfor %}{{ ns.x }}"), "2");
  EXPECT_EQ(render("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}"), "2");
}

TEST(ChatTemplate, ConcurrentRendersShareOneParsedTemplate) {
  TemplateJson doc = read_golden("chatml.json");
  ChatTemplate t(doc["template"].get<std::string>());
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i)
        for (const auto& c : doc["cases"])
          if (t.render(c["context"]) != c["expected"].get<std::string>()) bad++;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace k3::serve
