// Chat templates for `k3 serve`: a model's chat prompt format (its Jinja `chat_template`, rendered
// by text/jinja.h, plus the special tokens transformers passes), read from a Hugging Face
// tokenizer_config.json, so a chat request becomes the exact prompt text the model was trained on
// (what transformers' apply_chat_template produces).
#pragma once

#include <optional>
#include <string>

#include "io/config.h"
#include "text/jinja.h"

namespace k3::serve {

// A model's chat prompt format: its template plus the variables transformers passes besides the
// messages (the special tokens: bos_token, eos_token, ... as strings).
struct ChatFormat {
  ChatTemplate tmpl;
  TemplateJson special_tokens = TemplateJson::object();
  std::string origin;  // where the template came from, for messages ("tokenizer_config.json", a file)

  // messages: [{role, content, ...}, ...]; tools: the request's tools (null: none); rendered with
  // add_generation_prompt = true.
  std::string render(const TemplateJson& messages, const TemplateJson& tools = nullptr) const;
};

// tokenizer_config.json's chat_template: a string, or a list of {name, template} of which the one
// named "default" is taken. nullopt when there is none; k3::Error when it has another shape.
std::optional<std::string> chat_template_source(const Json& tokenizer_config);

// tokenizer_config.json's special tokens (bos_token, eos_token, unk_token, pad_token, ...), each
// given as a string or as an object with a "content" string.
TemplateJson special_tokens_of(const Json& tokenizer_config);

}  // namespace k3::serve
