// The logprobs objects of OpenAI responses, for `k3 serve`. No HTTP here.
//   completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
//   chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
// A stream sends each chunk's tokens in an object of its own. text_offset counts bytes (the
// same as characters for ASCII text).
#pragma once

#include <string>
#include <vector>

#include "infer/serve/scheduler.h"
#include "io/config.h"

namespace k3 {

class Tokenizer;

namespace serve {

// One token's text as logprobs show it: its bytes (maybe part of a UTF-8 character; the JSON
// dump replaces invalid bytes), or "token_id:N" without a tokenizer or for an id it lacks
// (vLLM's spelling).
std::string token_text(const Tokenizer* tok, int64_t id);

class CompletionLogprobs {
 public:
  // text_offset: where the first token's text starts in the choice's text.
  CompletionLogprobs(const Tokenizer* tok, size_t text_offset) : tok_(tok), offset_(text_offset) {}
  void add_unscored(int64_t token);  // an echoed prompt's first token: null logprob and top
  void add(const TokenLogprob& lp);
  size_t text_offset() const { return offset_; }  // where the next token's text would start
  Json json() const;

 private:
  const Tokenizer* tok_;
  size_t offset_;
  Json tokens_ = Json::array(), logprobs_ = Json::array(), top_ = Json::array(), offsets_ = Json::array();
};

// The "content" array of a chat choice's logprobs.
Json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer* tok);

}  // namespace serve
}  // namespace k3
