// k3 serve's chat formatting around the Jinja engine (whose own tests are src/text/jinja_test.cc):
// the tokenizer_config.json plumbing, the variables ChatFormat passes, and chat requests through
// parse_request. Templates and expected text come from tests/data/chat_templates/*.json.
#include <gtest/gtest.h>

#include "infer/serve/chat_template.h"
#include "infer/serve/request.h"
#include "text/testing.h"
#include "tokenizer/bpe.h"

namespace k3::serve {
namespace {

using testing::read_golden;

std::shared_ptr<const ChatFormat> format_of(const std::string& source, const std::string& origin) {
  return std::make_shared<ChatFormat>(ChatFormat{ChatTemplate(source), {}, origin});
}

TEST(ChatTemplateConfig, SourceFromTokenizerConfig) {
  EXPECT_FALSE(chat_template_source(Json::object()));
  EXPECT_FALSE(chat_template_source(Json{{"chat_template", nullptr}}));
  EXPECT_EQ(*chat_template_source(Json{{"chat_template", "{{ x }}"}}), "{{ x }}");
  Json listed = {{"chat_template", Json::array({{{"name", "tool_use"}, {"template", "T"}},
                                                {{"name", "default"}, {"template", "D"}}})}};
  EXPECT_EQ(*chat_template_source(listed), "D");
  try {
    chat_template_source(Json{{"chat_template", Json::array({{{"name", "rag"}, {"template", "R"}}})}});
    ADD_FAILURE() << "no error without a default template";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none named \"default\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(chat_template_source(Json{{"chat_template", 5}}), Error);
}

TEST(ChatTemplateConfig, SpecialTokensAsStringsOrObjects) {
  Json cfg = {{"bos_token", "<s>"},
              {"eos_token", {{"__type", "AddedToken"}, {"content", "</s>"}, {"lstrip", false}}},
              {"pad_token", nullptr},
              {"additional_special_tokens", {"<|a|>", {{"content", "<|b|>"}}}}};
  TemplateJson t = special_tokens_of(cfg);
  EXPECT_EQ(t["bos_token"], "<s>");
  EXPECT_EQ(t["eos_token"], "</s>");
  EXPECT_FALSE(t.contains("pad_token"));
  EXPECT_EQ(t["additional_special_tokens"], TemplateJson::array({"<|a|>", "<|b|>"}));
}

TEST(ChatTemplateConfig, ChatFormatPassesWhatTransformersPasses) {
  // Same as rendering the golden context directly: special tokens, messages, add_generation_prompt,
  // tools and documents as None.
  TemplateJson doc = read_golden("llama3.json");
  const auto& c = doc["cases"][1];
  ChatFormat fmt{ChatTemplate(doc["template"].get<std::string>()),
                 {{"bos_token", c["context"]["bos_token"]}, {"eos_token", c["context"]["eos_token"]}},
                 "llama3.json"};
  EXPECT_EQ(fmt.render(c["context"]["messages"]), c["expected"].get<std::string>());
  EXPECT_EQ(format_of("{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}", "probe")
                ->render(TemplateJson::array()),
            "True True True");
}

// Chat requests through the request parser: the template's text is what gets tokenized, and a
// template that rejects the conversation is the client's 400.
Tokenizer byte_tokenizer() {
  BpeVocab v;
  for (int i = 0; i < 256; ++i) v.tokens.emplace_back(std::string(1, char(i)), i);
  v.specials.push_back({"<|im_end|>", 256});
  v.eos = "<|im_end|>";
  return Tokenizer::from_vocab(v, "test bytes");
}

// Limits for a byte tokenizer with the given chat format (by default, alternating.json's template).
ParseLimits chat_limits(std::shared_ptr<const ChatFormat> fmt = nullptr) {
  ParseLimits lim;
  lim.vocab_size = 300;
  lim.max_context = 512;
  if (!fmt) {
    TemplateJson doc = read_golden("alternating.json");
    fmt = std::make_shared<ChatFormat>(ChatFormat{ChatTemplate(doc["template"].get<std::string>()),
                                                  {{"bos_token", "<s>"}, {"eos_token", "</s>"}},
                                                  "tokenizer_config.json"});
  }
  lim.chat_format = std::move(fmt);
  return lim;
}

TEST(ChatTemplateRequest, ChatPromptsUseTheTemplate) {
  Tokenizer tok = byte_tokenizer();
  ParseLimits lim = chat_limits();
  auto r = parse_request(Endpoint::ChatCompletions,
                         R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]})",
                         lim, &tok);
  const std::string want = "<s>[INST] Be brief.\n\nHi [/INST]";
  ASSERT_EQ(r.prompt_ids.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(r.prompt_ids[i], uint8_t(want[i]));

  // A template's own special tokens become their ids.
  lim = chat_limits(format_of("{{ messages[0].content }}<|im_end|>", "t"));
  r = parse_request(Endpoint::ChatCompletions, R"({"messages":[{"role":"user","content":"ab"}]})", lim, &tok);
  EXPECT_EQ(r.prompt_ids, (std::vector<int64_t>{'a', 'b', 256}));
}

TEST(ChatTemplateRequest, TemplateErrorsAreClientErrors) {
  Tokenizer tok = byte_tokenizer();
  ParseLimits lim = chat_limits();
  try {
    parse_request(Endpoint::ChatCompletions,
                  R"({"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]})", lim, &tok);
    ADD_FAILURE() << "no error for two user messages in a row";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "chat_template_error");
    EXPECT_EQ(e.param, "messages");
    EXPECT_EQ(e.message, "the model's chat template (tokenizer_config.json) rejects these messages: "
                         "Conversation roles must alternate user/assistant/user/assistant/...");
    Json body = e.body();
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  }
  // A template that fails while rendering (not raise_exception) is a 400 too, with the position.
  lim = chat_limits(format_of("\n{{ messages[0].nope.deeper }}", "x.jinja"));
  try {
    parse_request(Endpoint::ChatCompletions, R"({"messages":[{"role":"user","content":"a"}]})", lim, &tok);
    ADD_FAILURE() << "no error";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "chat_template_error");
    EXPECT_NE(e.message.find("(x.jinja) failed on these messages at line 2, column"), std::string::npos) << e.message;
    EXPECT_NE(e.message.find("has no attribute 'nope'"), std::string::npos) << e.message;
  }
}

}  // namespace
}  // namespace k3::serve
