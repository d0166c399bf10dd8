#include "infer/serve/response.h"

#include "tokenizer/bpe.h"

namespace k3::serve {

std::string token_text(const Tokenizer* tok, int64_t id) {
  if (tok) {
    try {
      return tok->token_bytes(int32_t(id));
    } catch (const std::exception&) {  // an id the tokenizer has no bytes for
    }
  }
  return "token_id:" + std::to_string(id);
}

void CompletionLogprobs::add_unscored(int64_t token) {
  const std::string t = token_text(tok_, token);
  tokens_.push_back(t);
  logprobs_.push_back(nullptr);
  top_.push_back(nullptr);
  offsets_.push_back(offset_);
  offset_ += t.size();
}

void CompletionLogprobs::add(const TokenLogprob& lp) {
  const std::string t = token_text(tok_, lp.token);
  Json top = Json::object();  // OpenAI's shape: alternatives keyed by their text
  for (const auto& [id, v] : lp.top) top[token_text(tok_, id)] = v;
  tokens_.push_back(t);
  logprobs_.push_back(lp.logprob);
  top_.push_back(std::move(top));
  offsets_.push_back(offset_);
  offset_ += t.size();
}

Json CompletionLogprobs::json() const {
  return {{"tokens", tokens_}, {"token_logprobs", logprobs_}, {"top_logprobs", top_}, {"text_offset", offsets_}};
}

Json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer* tok) {
  auto entry = [&](int64_t id, float logprob) {
    const std::string t = token_text(tok, id);
    return Json{{"token", t}, {"logprob", logprob}, {"bytes", std::vector<uint8_t>(t.begin(), t.end())}};
  };
  Json content = Json::array();
  for (const auto& lp : lps) {
    Json e = entry(lp.token, lp.logprob);
    e["top_logprobs"] = Json::array();
    for (const auto& [id, v] : lp.top) e["top_logprobs"].push_back(entry(id, v));
    content.push_back(std::move(e));
  }
  return content;
}

}  // namespace k3::serve
