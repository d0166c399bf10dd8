// Tool calls and reasoning in chat output, for `k3 serve`: the model's text split into
// reasoning_content (a leading <think>...</think>), content, and OpenAI tool_calls parsed from the
// model family's own call syntax. No HTTP here.
//
// Formats, chosen by the special tokens of the model's tokenizer:
//   hermes    (Qwen3 and others)  <tool_call>{"name": N, "arguments": {...}}</tool_call>, one per call
//   kimi      (Kimi K2, Kimi Linear, K3)  <|tool_calls_section_begin|> then per call
//             <|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}<|tool_call_end|>,
//             then <|tool_calls_section_end|>; the call's id is functions.N:I
//   deepseek  (DeepSeek-V3)  <｜tool▁calls▁begin｜> then per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>N
//             ```json {...} ```<｜tool▁call▁end｜> (or, as V3.1 writes it, N<｜tool▁sep｜>{...}), then
//             <｜tool▁calls▁end｜>
// A call is kept when its name is one of the request's tools and its arguments are a JSON object;
// a section with any other call is left in the content as the model wrote it (never an error).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/config.h"

namespace k3 {

class Tokenizer;

namespace serve {

enum class ToolFormat : uint8_t { None, Hermes, Kimi, DeepSeek };
const char* tool_format_name(ToolFormat f);
ToolFormat tool_format_of(const Tokenizer& tok);  // None: no format's tokens in the vocabulary
// The markers ChatOutput reads (reasoning, and the format's calls): special tokens kept in text.
std::vector<std::string> output_markers(ToolFormat f);

struct ToolCall {
  std::string id, name, arguments;  // arguments: the JSON object's text
};

// What the assistant turn must begin with so that the model calls `name` (tool_choice naming a
// function), and what closes the call after its arguments.
struct ForcedCall {
  std::string open, close;
};
ForcedCall forced_call(ToolFormat f, const std::string& name);

struct ChatDelta {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
  bool empty() const { return reasoning.empty() && content.empty() && calls.empty(); }
  void append(ChatDelta more) {
    reasoning += more.reasoning;
    content += more.content;
    for (auto& c : more.calls) calls.push_back(std::move(c));
  }
};

// Splits a chat choice's text as it streams in. Text that may begin a marker is held back until
// it cannot; a tool-call section is held whole until it closes, then sent as calls (or as content
// when it does not parse).
class ChatOutput {
 public:
  // tools: the request's function names (empty: no tool parsing). reasoning_open: the prompt
  // ended inside <think> (the model's output starts as reasoning). forced: the call the prompt
  // opened (tool_choice), whose arguments the output is; its close is added at the end.
  ChatOutput(ToolFormat format, std::vector<std::string> tools, bool reasoning_open, const ForcedCall* forced = nullptr);
  ChatDelta push(const std::string& text);
  ChatDelta finish();  // the rest; an unclosed section is content
  bool called() const { return calls_ > 0; }

 private:
  enum class State : uint8_t { Start, Reasoning, Content, Section };
  void run(ChatDelta& d, bool final);
  // Moves held text before `marker` to `to`; true when the marker is next in held_. Otherwise
  // keeps back what may begin it (nothing when final).
  bool take_until(const std::string& marker, std::string& to, bool final);
  bool parse_section(const std::string& section, std::vector<ToolCall>& out) const;
  ToolFormat format_;
  std::vector<std::string> tools_;
  std::string open_, close_;  // the format's section markers
  State state_;
  std::string held_;
  std::string forced_close_;            // added at the end
  std::optional<ForcedCall> forced_;    // until the forced section is read
  int64_t calls_ = 0;
  bool after_reasoning_ = false;  // newlines right after </think> are dropped
};

}  // namespace serve
}  // namespace k3
