// Request parsing and validation for `k3 serve` (OpenAI's /v1/completions and
// /v1/chat/completions bodies). No HTTP here: a body string goes in, a validated request or an
// OpenAI-style error (HTTP status + {"error": {message, type, param, code}}) comes out, so the
// parser is unit-tested and fuzzed without a socket.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "infer/json_constraint.h"
#include "infer/sampler.h"
#include "infer/serve/chat_template.h"
#include "infer/serve/tool_calls.h"
#include "io/config.h"

namespace k3 {

class Tokenizer;

namespace serve {

// An error meant for the client: HTTP status and the OpenAI error object's fields.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" -> null
  std::string code;   // "" -> null
  Json body() const;  // {"error": {...}}
};

enum class Endpoint : uint8_t { Completions, ChatCompletions };

// What the parser needs to know about the model being served.
struct ParseLimits {
  int64_t vocab_size = 0;
  int64_t max_context = 0;          // prompt + max_tokens must fit
  int64_t default_max_tokens = 16;  // /v1/completions default (OpenAI's); chat: the rest of the context
  int64_t max_n = 16;               // choices per request
  int64_t max_logprobs = 20;        // alternatives per token
  size_t max_body_bytes = 8u << 20;
  int max_json_depth = 64;
  double max_timeout_s = 3600;
  double default_timeout_s = 600;
  // The tokenizer's longest token in bytes (0: unknown): text prompts longer than the context
  // allows at that many bytes a token are refused without being tokenised.
  int64_t longest_token_bytes = 0;
  // How chat messages become the prompt: the model's chat template, or (null) plain_chat_template.
  std::shared_ptr<const ChatFormat> chat_format;
  // How the model writes tool calls (from its tokenizer's special tokens); None: tools refused.
  ToolFormat tool_format = ToolFormat::None;
};

// The longest token of TOK, in bytes (the specials' text included).
int64_t longest_token_bytes(const Tokenizer& tok);

struct ParsedRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;                // as the client named it ("" if absent)
  std::vector<int64_t> prompt_ids;  // the tokenized (or given) prompt
  bool prompt_was_text = false;
  std::string prompt_text;          // a completions text prompt as given (for echo)
  int64_t max_tokens = 16;
  SamplingOptions sampling;         // validated
  bool stream = false;
  bool include_usage = false;       // stream_options.include_usage
  bool ignore_eos = false;          // extension
  bool echo = false;                // completions: the prompt leads each choice's text
  int64_t n = 1;                    // choices; choice i samples with seed + i
  // Logprobs per token with this many alternatives (-1: none). Completions: the integer
  // `logprobs`; chat: `top_logprobs` (0 if absent) when `logprobs` is true.
  int64_t logprobs = -1;
  std::vector<std::string> stop;    // stop strings (at most 4)
  double timeout_s = 600;           // extension: per-request wall-clock limit
  // response_format json_object or json_schema: the output is constrained to it (json_constraint.h)
  std::shared_ptr<const JsonSchema> json;
  // Chat: the tools whose calls are parsed from the output (empty: none, or tool_choice none);
  // the call the prompt opened (tool_choice naming a function, or required); whether the
  // prompt ended inside <think> (the output begins as reasoning).
  std::vector<std::string> tool_names;
  std::optional<ForcedCall> forced_call;
  bool reasoning_open = false;
};

// The plain chat template used when the model folder has none (or its template does not parse):
// one "role: content" line per message, then "assistant:" to cue the reply.
std::string plain_chat_template(const std::vector<std::pair<std::string, std::string>>& messages);

// Parses and validates a request body. tok may be null (then text prompts are rejected). Throws
// ApiError (never anything else for any input); a chat template that rejects the messages
// (raise_exception) or fails on them is a 400 with code "chat_template_error".
ParsedRequest parse_request(Endpoint ep, const std::string& body, const ParseLimits& limits, const Tokenizer* tok);

// Nesting depth of a JSON text (brackets outside strings), computed without recursion; the
// parser rejects deep bodies before nlohmann's recursive parser sees them.
int json_depth(const std::string& text);

}  // namespace serve
}  // namespace k3
