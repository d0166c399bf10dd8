// Chat output split into reasoning, content and tool calls (infer/serve/tool_calls.h): outputs
// written here in each family's call syntax give exactly the calls in them, whole or streamed in
// pieces cut anywhere; anything malformed stays text.
#include "infer/serve/tool_calls.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

#include "core/random.h"
#include "infer/serve/request.h"
#include "tokenizer/bpe.h"

namespace k3::serve {
namespace {

ChatDelta run_all(ChatOutput& out, const std::string& text, Rng* rng) {
  ChatDelta all;
  if (!rng) {
    all.append(out.push(text));
  } else {
    for (size_t at = 0; at < text.size();) {
      const size_t n = std::min(text.size() - at, size_t(1 + rng->below(5)));
      all.append(out.push(text.substr(at, n)));
      at += n;
    }
  }
  all.append(out.finish());
  return all;
}

struct Case {
  ToolFormat format;
  std::string text;
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};

TEST(ToolCalls, EachFormatsCallsWholeAndStreamed) {
  const std::vector<std::string> tools = {"get_weather", "add"};
  const std::vector<Case> cases = {
      {ToolFormat::Hermes,
       "<think>\nThe user wants weather.\n</think>\n\nLet me check.<tool_call>\n{\"name\": \"get_weather\", "
       "\"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", "
       "\"arguments\": \"{\\\"a\\\": 1, \\\"b\\\": 2}\"}\n</tool_call>",
       "\nThe user wants weather.\n",
       "Let me check.\n",
       {{"get_weather", "{\"city\":\"Paris\",\"unit\":\"c\"}"}, {"add", "{\"a\":1,\"b\":2}"}}},
      {ToolFormat::Kimi,
       "I will call.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
       "{\"city\": \"\xe5\x8c\x97\xe4\xba\xac\"}<|tool_call_end|> <|tool_call_begin|>functions.add:1"
       "<|tool_call_argument_begin|>{\"b\": 2, \"a\": 1}<|tool_call_end|><|tool_calls_section_end|>",
       "",
       "I will call.",
       {{"get_weather", "{\"city\":\"\xe5\x8c\x97\xe4\xba\xac\"}"}, {"add", "{\"b\":2,\"a\":1}"}}},
      {ToolFormat::DeepSeek,
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```"
       "<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       "",
       "",
       {{"get_weather", "{\"city\":\"Oslo\"}"}, {"add", "{\"a\":3}"}}},
      // Malformed: arguments not an object, an unknown function, an unclosed section; all text.
      {ToolFormat::Hermes, "a<tool_call>{\"name\": \"add\", \"arguments\": [1]}</tool_call>b", "",
       "a<tool_call>{\"name\": \"add\", \"arguments\": [1]}</tool_call>b", {}},
      {ToolFormat::Kimi,
       "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
       "<|tool_calls_section_end|>",
       "", "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>", {}},
      {ToolFormat::DeepSeek, "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\"", "",
       "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\"", {}},
      // A marker's prefix that never completes is text.
      {ToolFormat::Hermes, "x < y and <tool", "", "x < y and <tool", {}},
      {ToolFormat::Hermes, "  <thin", "", "  <thin", {}},
  };
  Rng rng(9);
  for (const auto& c : cases) {
    for (int streamed = 0; streamed < 4; ++streamed) {
      ChatOutput out(c.format, tools, false);
      const ChatDelta d = run_all(out, c.text, streamed ? &rng : nullptr);
      SCOPED_TRACE(c.text + (streamed ? " (streamed)" : ""));
      EXPECT_EQ(d.reasoning, c.reasoning);
      EXPECT_EQ(d.content, c.content);
      ASSERT_EQ(d.calls.size(), c.calls.size());
      for (size_t k = 0; k < c.calls.size(); ++k) {
        EXPECT_EQ(d.calls[k].name, c.calls[k].first);
        EXPECT_EQ(d.calls[k].arguments, c.calls[k].second);
        EXPECT_FALSE(d.calls[k].id.empty());
        if (c.format != ToolFormat::Kimi) {  // call_ and 24 letters or digits
          EXPECT_EQ(d.calls[k].id.size(), 29u);
          EXPECT_TRUE(std::all_of(d.calls[k].id.begin() + 5, d.calls[k].id.end(), [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)); }));
        }
      }
      EXPECT_EQ(out.called(), !c.calls.empty());
    }
  }
  // Kimi's call ids are the model's own.
  ChatOutput kimi(ToolFormat::Kimi, tools, false);
  EXPECT_EQ(run_all(kimi, cases[1].text, nullptr).calls[1].id, "functions.add:1");
}

TEST(ToolCalls, ReasoningOpenedByThePromptAndNoTools) {
  // The prompt ended with <think>: the output starts as reasoning.
  ChatOutput open(ToolFormat::None, {}, true);
  ChatDelta d = run_all(open, "step 1, step 2</think>\n\nThe answer is 4.", nullptr);
  EXPECT_EQ(d.reasoning, "step 1, step 2");
  EXPECT_EQ(d.content, "The answer is 4.");
  // Without tools a call's syntax is plain content.
  ChatOutput plain(ToolFormat::Hermes, {}, false);
  d = run_all(plain, "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>", nullptr);
  EXPECT_TRUE(d.calls.empty());
  EXPECT_EQ(d.content, "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>");
  // Reasoning cut off by max_tokens stays reasoning.
  ChatOutput cut(ToolFormat::None, {}, false);
  d = run_all(cut, "<think>I am still thinking", nullptr);
  EXPECT_EQ(d.reasoning, "I am still thinking");
  EXPECT_EQ(d.content, "");
}

TEST(ToolCalls, ForcedCallsCloseAfterTheirArguments) {
  for (ToolFormat f : {ToolFormat::Hermes, ToolFormat::Kimi, ToolFormat::DeepSeek}) {
    const ForcedCall fc = forced_call(f, "add");
    ChatOutput out(f, {"add"}, false, &fc);
    const ChatDelta d = run_all(out, "{\"a\": 1, \"b\": 2}", nullptr);
    ASSERT_EQ(d.calls.size(), 1u) << tool_format_name(f);
    EXPECT_EQ(d.calls[0].name, "add");
    EXPECT_EQ(d.calls[0].arguments, "{\"a\":1,\"b\":2}");
    EXPECT_EQ(d.content, "");
    // Cut short by max_tokens: the model's text alone, as content.
    ChatOutput cut(f, {"add"}, false, &fc);
    const ChatDelta c = run_all(cut, "{\"a\": 1, \"b", nullptr);
    EXPECT_TRUE(c.calls.empty());
    EXPECT_EQ(c.content, "{\"a\": 1, \"b") << tool_format_name(f);
  }
}

Tokenizer tokenizer_with(const std::vector<std::string>& specials) {
  BpeVocab v;
  for (int i = 0; i < 256; ++i) v.tokens.emplace_back(std::string(1, char(i)), i);
  int id = 256;
  for (const auto& s : specials) v.specials.push_back({s, id++});
  return Tokenizer::from_vocab(v, "test");
}

TEST(ToolCalls, FormatFromTheTokenizersSpecialTokens) {
  EXPECT_EQ(tool_format_of(tokenizer_with({"<tool_call>", "</tool_call>"})), ToolFormat::Hermes);
  EXPECT_EQ(tool_format_of(tokenizer_with({"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"})),
            ToolFormat::Kimi);
  EXPECT_EQ(tool_format_of(tokenizer_with({"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"})), ToolFormat::DeepSeek);
  EXPECT_EQ(tool_format_of(tokenizer_with({"<|endoftext|>"})), ToolFormat::None);
}

// The request side: tools reach the template in the client's key order, tool_choice names a
// function (the prompt opens its call, the output is its arguments), bad tools are 400s.
TEST(ToolCalls, RequestsWithTools) {
  const Tokenizer tok = tokenizer_with({"<tool_call>", "</tool_call>", "<|endoftext|>"});
  ParseLimits lim;
  lim.vocab_size = 259;
  lim.max_context = 4096;
  lim.tool_format = tool_format_of(tok);
  auto fmt = std::make_shared<ChatFormat>(ChatFormat{ChatTemplate(
      "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
      "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% if m.tool_call_id %}#{{ m.tool_call_id }}"
      "{% endif %}\n{% endfor %}assistant:"),
                                                    TemplateJson::object(), "test template"});
  lim.chat_format = fmt;
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"add","parameters":{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}},"required":["a","b"]}}}])";
  const std::string msgs =
      R"("messages":[{"role":"user","content":"1+2?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"add","arguments":"{\"a\":1,\"b\":2}"}}]},{"role":"tool","tool_call_id":"c1","content":"3"}])";
  auto text = [&](const ParsedRequest& r) {
    return tok.decode(std::vector<int32_t>(r.prompt_ids.begin(), r.prompt_ids.end()));
  };
  ParsedRequest r = parse_request(Endpoint::ChatCompletions, "{" + msgs + "," + tools + "}", lim, &tok);
  EXPECT_EQ(r.tool_names, std::vector<std::string>{"add"});
  EXPECT_FALSE(r.forced_call);
  const std::string p = text(r);
  EXPECT_NE(p.find(R"("properties": {"b": {"type": "integer"}, "a")"), std::string::npos) << p;  // key order kept
  EXPECT_NE(p.find(R"(assistant:[{"id": "c1")"), std::string::npos) << p;
  EXPECT_NE(p.find("tool:3#c1"), std::string::npos) << p;
  r = parse_request(Endpoint::ChatCompletions,
                    "{" + msgs + "," + tools + R"(,"tool_choice":{"type":"function","function":{"name":"add"}}})", lim, &tok);
  ASSERT_TRUE(r.forced_call && r.json);
  EXPECT_EQ(text(r).substr(text(r).size() - r.forced_call->open.size()), r.forced_call->open);
  JsonMatcher m(r.json);
  EXPECT_FALSE(m.feed("{\"a\": 1}") && m.done());  // b is required by the parameters
  r = parse_request(Endpoint::ChatCompletions, "{" + msgs + "," + tools + R"(,"tool_choice":"none"})", lim, &tok);
  EXPECT_TRUE(r.tool_names.empty());
  auto param_of = [&](const std::string& body, ParseLimits l) {
    try {
      parse_request(Endpoint::ChatCompletions, body, l, &tok);
    } catch (const ApiError& e) {
      return e.param;
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(param_of("{" + msgs + R"(,"tools":{}})", lim), "tools");
  EXPECT_EQ(param_of("{" + msgs + R"(,"tools":[{"type":"function","function":{}}]})", lim), "tools[0].function.name");
  EXPECT_EQ(param_of("{" + msgs + "," + tools + R"(,"tool_choice":{"type":"function","function":{"name":"sub"}}})", lim),
            "tool_choice");
  EXPECT_EQ(param_of("{" + msgs + R"(,"tool_choice":"required"})", lim), "tool_choice");
  ParseLimits no_format = lim;
  no_format.tool_format = ToolFormat::None;
  EXPECT_EQ(param_of("{" + msgs + "," + tools + "}", no_format), "tools");
  ParseLimits no_template = lim;
  no_template.chat_format = nullptr;
  EXPECT_EQ(param_of("{" + msgs + "," + tools + "}", no_template), "tools");
  try {
    parse_request(Endpoint::Completions, R"({"prompt":"x",)" + tools + "}", lim, &tok);
    ADD_FAILURE();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "tools");
  }
}

}  // namespace
}  // namespace k3::serve
