// k3 serve's chat formatting around the Jinja engine (text/jinja.h): the variables transformers
// passes to a chat template, and the template and special tokens of a tokenizer_config.json.
#include "infer/serve/chat_template.h"

#include <optional>
#include <string>
#include <vector>

namespace k3::serve {

std::string ChatFormat::render(const TemplateJson& messages, const TemplateJson& tools) const {
  TemplateJson ctx = special_tokens;
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = true;
  // transformers passes these as None when the request has none; templates test "tools is not none".
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  return tmpl.render(ctx);
}

std::optional<std::string> chat_template_source(const Json& cfg) {
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::vector<std::string> names;
    for (const auto& t : *it) {
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("template") ||
          !t["template"].is_string())
        throw error("chat template",
                    "tokenizer_config.json: chat_template list entries must be {name, template} strings");
      if (t["name"] == "default") return t["template"].get<std::string>();
      names.push_back(t["name"].get<std::string>());
    }
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw error("chat template", "tokenizer_config.json has chat templates named [", list,
                "] but none named \"default\"; pass one with --chat-template FILE");
  }
  throw error("chat template", "tokenizer_config.json: chat_template must be a string or a list of {name, template}");
}

TemplateJson special_tokens_of(const Json& cfg) {
  TemplateJson out = TemplateJson::object();
  auto text = [](const Json& t) -> std::optional<std::string> {
    if (t.is_string()) return t.get<std::string>();
    if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
    return std::nullopt;
  };
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    auto it = cfg.find(k);
    if (it == cfg.end()) continue;
    if (auto s = text(*it)) out[k] = *s;
  }
  if (auto it = cfg.find("additional_special_tokens"); it != cfg.end() && it->is_array()) {
    TemplateJson list = TemplateJson::array();
    for (const auto& t : *it)
      if (auto s = text(t)) list.push_back(*s);
    out["additional_special_tokens"] = list;
  }
  return out;
}

}  // namespace k3::serve
