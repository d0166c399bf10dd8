#include "infer/serve/request.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "tokenizer/bpe.h"

namespace k3::serve {

Json ApiError::body() const {
  Json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return Json{{"error", e}};
}

namespace {

[[noreturn]] void fail(const std::string& param, const std::string& message, const std::string& code = "",
                       int status = 400) {
  ApiError e;
  e.status = status;
  e.message = message;
  e.param = param;
  e.code = code;
  throw e;
}

const char* type_of(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    case Json::value_t::number_float: return "number";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    default: return "value";
  }
}

// A whole number (JSON integer, or a float with no fraction such as 5.0).
bool as_int(const Json& j, int64_t& out) {
  if (j.is_number_unsigned()) {  // before is_number_integer, which is true for unsigned too
    uint64_t u = j.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    out = int64_t(u);
    return true;
  }
  if (j.is_number_integer()) {
    out = j.get<int64_t>();
    return true;
  }
  if (j.is_number_float()) {
    double d = j.get<double>();
    if (!std::isfinite(d) || std::floor(d) != d || std::fabs(d) > 9.0e15) return false;
    out = int64_t(d);
    return true;
  }
  return false;
}

int64_t get_int(const Json& o, const char* name, int64_t lo, int64_t hi, int64_t dflt) {
  auto it = o.find(name);
  if (it == o.end() || it->is_null()) return dflt;
  int64_t v = 0;
  if (!as_int(*it, v)) {
    if (it->is_number_unsigned())  // an integer past int64: out of range, echoed as sent
      fail(name, std::string("'") + name + "' = " + it->dump() + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]", "invalid_value");
    fail(name, std::string("'") + name + "' must be an integer, got " + type_of(*it), "invalid_type");
  }
  if (v < lo || v > hi)
    fail(name, std::string("'") + name + "' = " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                   std::to_string(hi) + "]", "invalid_value");
  return v;
}

double get_num(const Json& o, const char* name, double lo, double hi, double dflt, bool lo_open = false) {
  auto it = o.find(name);
  if (it == o.end() || it->is_null()) return dflt;
  if (!it->is_number()) fail(name, std::string("'") + name + "' must be a number, got " + type_of(*it), "invalid_type");
  double v = it->get<double>();
  bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
  if (!ok) {
    std::string range = std::string(lo_open ? "(" : "[") + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    fail(name, std::string("'") + name + "' = " + std::to_string(v) + " is outside " + range, "invalid_value");
  }
  return v;
}

bool get_bool(const Json& o, const char* name, bool dflt) {
  auto it = o.find(name);
  if (it == o.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) fail(name, std::string("'") + name + "' must be a boolean, got " + type_of(*it), "invalid_type");
  return it->get<bool>();
}

void tokenize_into(const std::string& text, const Tokenizer* tok, const char* param, std::vector<int64_t>& out,
                   const ParseLimits& lim) {
  if (!tok)
    fail(param, "this model has no tokenizer files: give the prompt as an array of token ids", "tokenizer_missing");
  // No token is longer than the vocabulary's longest, so a text that long has at least this many
  // tokens: a prompt that cannot fit is refused before it is tokenised (and held as ids).
  if (lim.longest_token_bytes > 0 && lim.max_context > 0) {
    const size_t least = (text.size() + size_t(lim.longest_token_bytes) - 1) / size_t(lim.longest_token_bytes);
    if (least >= size_t(lim.max_context))
      fail(param, "the prompt has at least " + std::to_string(least) + " tokens (" + std::to_string(text.size()) +
                      " bytes); this server's context is " + std::to_string(lim.max_context) + " tokens",
           "context_length_exceeded");
  }
  // Encoding stops as soon as the prompt is over the context (never holding more ids than that).
  std::vector<int32_t> ids;
  const size_t room = lim.max_context > 0 ? size_t(std::max<int64_t>(0, lim.max_context - int64_t(out.size())))
                                          : Tokenizer::kNoLimit;
  tok->encode_into(text, ids, room);
  if (ids.size() > room)
    fail(param, "the prompt has more than " + std::to_string(lim.max_context) +
                    " tokens; this server's context is " + std::to_string(lim.max_context) + " tokens",
         "context_length_exceeded");
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int64_t> token_array(const Json& a, const char* param, int64_t vocab) {
  std::vector<int64_t> ids;
  ids.reserve(a.size());
  for (const auto& x : a) {
    int64_t v = 0;
    if (x.is_number_unsigned() && !as_int(x, v))  // past int64: echoed as sent
      fail(param, "token id " + x.dump() + " is outside the vocabulary [0, " + std::to_string(vocab) + ")",
           "invalid_value");
    if (!as_int(x, v)) fail(param, std::string("'") + param + "' token ids must be integers, got " + type_of(x), "invalid_type");
    if (v < 0 || v >= vocab)
      fail(param, "token id " + std::to_string(v) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")",
           "invalid_value");
    ids.push_back(v);
  }
  return ids;
}

std::string message_text(const Json& content, size_t i) {
  const std::string p = "messages[" + std::to_string(i) + "].content";
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (!content.is_array()) fail(p, p + " must be a string or an array of content parts", "invalid_type");
  std::string s;
  for (const auto& part : content) {
    if (!part.is_object()) fail(p, p + " parts must be objects", "invalid_type");
    auto t = part.find("type");
    if (t == part.end() || !t->is_string() || t->get<std::string>() != "text")
      fail(p, p + ": only parts of type \"text\" are supported", "invalid_value");
    auto tx = part.find("text");
    if (tx == part.end() || !tx->is_string()) fail(p, p + ": a text part needs a string 'text'", "invalid_type");
    s += tx->get<std::string>();
  }
  return s;
}

}  // namespace

int json_depth(const std::string& text) {
  int depth = 0, best = 0;
  bool in_str = false, esc = false;
  for (char c : text) {
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '[' || c == '{') best = std::max(best, ++depth);
    else if (c == ']' || c == '}') --depth;
  }
  return best;
}

std::string plain_chat_template(const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string s;
  for (const auto& [role, content] : messages) s += role + ": " + content + "\n";
  s += "assistant:";
  return s;
}

namespace {
// tools and tool_choice (chat): validated; the names to parse calls of go to r.tool_names.
void parse_tools(const TemplateJson& o, const ParseLimits& lim, ParsedRequest& r, TemplateJson& tools,
                 std::string& choice, std::string& forced) {
  std::vector<std::string> names;
  if (o.contains("tools") && !o["tools"].is_null()) {
    const TemplateJson& ts = o["tools"];
    if (!ts.is_array()) fail("tools", "'tools' must be an array", "invalid_type");
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::string p = "tools[" + std::to_string(i) + "]";
      const TemplateJson& t = ts[i];
      if (!t.is_object() || !t.contains("type") || t["type"] != "function" || !t.contains("function") ||
          !t["function"].is_object())
        fail(p, p + " must be {\"type\": \"function\", \"function\": {...}}", "invalid_value");
      const TemplateJson& f = t["function"];
      if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
        fail(p + ".function.name", p + ".function.name must be a non-empty string", "invalid_value");
      if (f.contains("parameters") && !f["parameters"].is_object())
        fail(p + ".function.parameters", p + ".function.parameters must be a JSON Schema object", "invalid_type");
      names.push_back(f["name"].get<std::string>());
    }
    if (!names.empty()) tools = ts;
  }
  choice = names.empty() ? "none" : "auto";
  if (o.contains("tool_choice") && !o["tool_choice"].is_null()) {
    const TemplateJson& c = o["tool_choice"];
    if (c.is_string()) {
      choice = c.get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required")
        fail("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", ...}", "invalid_value");
    } else if (c.is_object() && c.contains("function") && c["function"].is_object() && c["function"].contains("name") &&
               c["function"]["name"].is_string()) {
      choice = "function";
      forced = c["function"]["name"].get<std::string>();
      if (std::find(names.begin(), names.end(), forced) == names.end())
        fail("tool_choice", "tool_choice names '" + forced + "', which is not among the tools", "invalid_value");
    } else {
      fail("tool_choice", "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
           "invalid_value");
    }
    if (choice != "none" && names.empty()) fail("tool_choice", "tool_choice needs tools", "invalid_value");
  }
  if (choice == "none") return;
  if (!lim.chat_format)
    fail("tools", "tools need the model's chat template, and this model has none (--chat-template FILE gives one)",
         "unsupported");
  if (lim.tool_format == ToolFormat::None)
    fail("tools", "this model's tokenizer has none of the tool-call formats k3 reads (hermes <tool_call>, kimi, deepseek)",
         "unsupported");
  if (choice == "required" && names.size() == 1) choice = "function", forced = names[0];
  if (choice == "required" && lim.tool_format != ToolFormat::Hermes)
    fail("tool_choice", std::string("tool_choice required among several tools needs a format that names the function ") +
                            "inside its JSON (hermes); this model writes " + tool_format_name(lim.tool_format) +
                            " calls: name the function instead",
         "unsupported");
  if (r.json) fail("tool_choice", "tool_choice and response_format cannot both shape the output", "invalid_value");
  r.tool_names = names;
}

// tool_choice required or naming a function: the prompt opens the call, and the output (its
// arguments; for required, the call's JSON) is constrained to the function's parameters.
void force_call(const ParseLimits& lim, ParsedRequest& r, const TemplateJson& tools, const std::string& name,
                std::string& prompt) {
  if (name.empty()) {  // required, hermes: {"name": one of them, "arguments": {...}}
    Json names = Json::array();
    for (const auto& n : r.tool_names) names.push_back(n);
    r.forced_call = ForcedCall{"<tool_call>\n", "\n</tool_call>"};
    r.json = JsonSchema::compile(Json{{"type", "object"},
                                      {"properties", {{"name", {{"enum", names}}}, {"arguments", {{"type", "object"}}}}},
                                      {"required", {"name", "arguments"}}});
  } else {
    r.forced_call = forced_call(lim.tool_format, name);
    r.json = JsonSchema::any_object();
    for (const auto& t : tools)
      if (t["function"]["name"] == name && t["function"].contains("parameters")) {
        try {  // keywords the constraint does not read leave the arguments any JSON object
          r.json = JsonSchema::compile(Json::parse(t["function"]["parameters"].dump()));
        } catch (const Error&) {
        }
      }
  }
  prompt += r.forced_call->open;
}

ParsedRequest parse_impl(Endpoint ep, const std::string& body, const ParseLimits& lim, const Tokenizer* tok) {
  ParsedRequest r;
  r.endpoint = ep;
  if (body.size() > lim.max_body_bytes)
    fail("", "request body of " + std::to_string(body.size()) + " bytes exceeds the limit of " +
                 std::to_string(lim.max_body_bytes), "body_too_large", 413);
  if (json_depth(body) > lim.max_json_depth)
    fail("", "request JSON nests deeper than " + std::to_string(lim.max_json_depth) + " levels", "invalid_json");
  Json j;
  try {
    j = Json::parse(body);
  } catch (const std::exception& e) {
    fail("", std::string("malformed JSON body: ") + e.what(), "invalid_json");
  }
  if (!j.is_object()) fail("", std::string("the request body must be a JSON object, got ") + type_of(j), "invalid_json");

  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) fail("model", "'model' must be a string", "invalid_type");
    r.model = it->get<std::string>();
  }
  r.n = get_int(j, "n", 1, lim.max_n, 1);
  if (get_int(j, "best_of", 1, lim.max_n, r.n) != r.n)
    fail("best_of", "best_of must equal n (choices are not ranked)", "unsupported");
  if (ep == Endpoint::Completions) {
    if (auto it = j.find("logprobs"); it != j.end() && !(it->is_boolean() && !it->get<bool>()))
      r.logprobs = get_int(j, "logprobs", 0, lim.max_logprobs, -1);
  } else {
    const int64_t top = get_int(j, "top_logprobs", 0, lim.max_logprobs, -1);
    if (get_bool(j, "logprobs", false)) r.logprobs = std::max<int64_t>(top, 0);
    else if (top >= 0) fail("top_logprobs", "'top_logprobs' needs 'logprobs': true", "invalid_value");
  }
  // Accepted, type-checked and ignored: OpenAI fields that clients send by default.
  get_num(j, "frequency_penalty", -2, 2, 0);
  get_num(j, "presence_penalty", -2, 2, 0);
  if (auto it = j.find("user"); it != j.end() && !it->is_null() && !it->is_string())
    fail("user", "'user' must be a string", "invalid_type");

  r.stream = get_bool(j, "stream", false);
  r.echo = get_bool(j, "echo", false);
  if (r.echo && ep == Endpoint::ChatCompletions) fail("echo", "echo is a /v1/completions field", "unsupported");
  if (ep == Endpoint::Completions)
    for (const char* k : {"tools", "tool_choice"})
      if (j.contains(k) && !j[k].is_null()) fail(k, std::string(k) + " is a /v1/chat/completions field", "unsupported");
  r.ignore_eos = get_bool(j, "ignore_eos", false);
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) fail("stream_options", "'stream_options' must be an object", "invalid_type");
    r.include_usage = get_bool(*it, "include_usage", false);
  }

  // Sampling.
  r.sampling.temperature = float(get_num(j, "temperature", 0, 2, 1.0));
  r.sampling.top_p = float(get_num(j, "top_p", 0, 1, 1.0, /*lo_open=*/true));
  r.sampling.top_k = get_int(j, "top_k", -1, 1 << 30, 0);
  if (r.sampling.top_k < 0) r.sampling.top_k = 0;  // vLLM's "-1 = off"
  r.sampling.repetition_penalty = float(get_num(j, "repetition_penalty", 0, 10, 1.0, /*lo_open=*/true));
  r.sampling.seed = uint64_t(get_int(j, "seed", 0, std::numeric_limits<int64_t>::max(), 0));
  try {
    r.sampling.validate();
  } catch (const Error& e) {
    fail("", e.what(), "invalid_value");
  }
  r.timeout_s = get_num(j, "timeout", 0, lim.max_timeout_s, lim.default_timeout_s, /*lo_open=*/true);

  // Structured output: the completion is constrained to JSON (an object, or a schema's instances).
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    const Json& rf = *it;
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      fail("response_format", "'response_format' must be an object with a 'type'", "invalid_type");
    const std::string type = rf["type"].get<std::string>();
    if (type == "json_object" || type == "json_schema") {
      if (!tok) fail("response_format", "response_format needs the model's tokenizer, which this server lacks", "unsupported");
      if (type == "json_object") {
        r.json = JsonSchema::any_object();
      } else {
        const Json* js = rf.contains("json_schema") ? &rf["json_schema"] : nullptr;
        if (!js || !js->is_object() || !js->contains("schema"))
          fail("response_format", "json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
               "missing_field");
        try {
          r.json = JsonSchema::compile((*js)["schema"]);
        } catch (const Error& e) {
          fail("response_format", e.what(), "invalid_value");
        }
      }
    } else if (type != "text") {
      fail("response_format", "response_format type must be text, json_object or json_schema, not '" + type + "'",
           "invalid_value");
    }
  }

  // Stop strings.
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      r.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 4) fail("stop", "at most 4 stop sequences", "invalid_value");
      for (const auto& s : *it) {
        if (!s.is_string()) fail("stop", "'stop' entries must be strings", "invalid_type");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      fail("stop", "'stop' must be a string or an array of strings", "invalid_type");
    }
    for (const auto& s : r.stop)
      if (s.empty()) fail("stop", "stop sequences must not be empty", "invalid_value");
  }

  // Prompt.
  if (ep == Endpoint::Completions) {
    auto it = j.find("prompt");
    if (it == j.end() || it->is_null()) fail("prompt", "'prompt' is required", "missing_field");
    const Json& p = *it;
    if (p.is_string()) {
      r.prompt_text = p.get<std::string>();
      tokenize_into(r.prompt_text, tok, "prompt", r.prompt_ids, lim);
      r.prompt_was_text = true;
    } else if (p.is_array()) {
      if (p.empty()) fail("prompt", "'prompt' is an empty array", "invalid_value");
      if (p[0].is_array() || p[0].is_string()) {  // a batch of prompts: only a batch of one
        if (p.size() != 1) fail("prompt", "only one prompt per request is supported", "unsupported");
        if (p[0].is_string()) {
          r.prompt_text = p[0].get<std::string>();
          tokenize_into(r.prompt_text, tok, "prompt", r.prompt_ids, lim);
          r.prompt_was_text = true;
        } else {
          r.prompt_ids = token_array(p[0], "prompt", lim.vocab_size);
        }
      } else {
        r.prompt_ids = token_array(p, "prompt", lim.vocab_size);
      }
    } else {
      fail("prompt", std::string("'prompt' must be a string or an array of token ids, got ") + type_of(p), "invalid_type");
    }
  } else {
    auto it = j.find("messages");
    if (it == j.end() || it->is_null()) fail("messages", "'messages' is required", "missing_field");
    if (!it->is_array() || it->empty()) fail("messages", "'messages' must be a non-empty array", "invalid_type");
    std::vector<std::pair<std::string, std::string>> msgs;
    TemplateJson conversation = TemplateJson::array();  // what a Jinja chat template sees as `messages`
    // Tools and tool-call fields go to the template as the client sent them, key order included
    // (tojson prints them in that order), so they are read from an order-keeping parse.
    const bool tooling = j.contains("tools") || j.contains("tool_choice") || body.find("\"tool_call") != std::string::npos;
    const TemplateJson ordered = tooling ? TemplateJson::parse(body) : TemplateJson();
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& m = (*it)[i];
      const std::string p = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) fail(p, p + " must be an object", "invalid_type");
      auto role = m.find("role");
      if (role == m.end() || !role->is_string()) fail(p + ".role", p + ".role must be a string", "invalid_type");
      std::string rs = role->get<std::string>();
      if (rs != "system" && rs != "user" && rs != "assistant" && rs != "developer" && rs != "tool")
        fail(p + ".role", "unknown role '" + rs + "'", "invalid_value");
      auto content = m.find("content");
      msgs.emplace_back(rs, content == m.end() ? std::string() : message_text(*content, i));
      TemplateJson msg = {{"role", rs}, {"content", msgs.back().second}};
      if (tooling) {
        const TemplateJson& om = ordered["messages"][i];
        if (om.contains("tool_calls") && !om["tool_calls"].is_null()) {
          if (!om["tool_calls"].is_array() || rs != "assistant")
            fail(p + ".tool_calls", p + ".tool_calls must be an array on an assistant message", "invalid_value");
          msg["tool_calls"] = om["tool_calls"];
        }
        for (const char* k : {"tool_call_id", "name", "reasoning_content"})
          if (om.contains(k) && !om[k].is_null()) {
            if (!om[k].is_string()) fail(p + "." + k, p + "." + k + " must be a string", "invalid_type");
            msg[k] = om[k];
          }
      }
      conversation.push_back(std::move(msg));
    }
    TemplateJson tools = nullptr;
    std::string choice = "none", forced;
    if (tooling) parse_tools(ordered, lim, r, tools, choice, forced);
    std::string prompt;
    if (lim.chat_format) {
      try {
        prompt = lim.chat_format->render(conversation, tools);
      } catch (const TemplateError& e) {
        const std::string origin = " (" + lim.chat_format->origin + ")";
        if (e.kind() == TemplateError::Kind::Raised)
          fail("messages", "the model's chat template" + origin + " rejects these messages: " + e.message(),
               "chat_template_error");
        const std::string at = e.line() > 0 ? " at line " + std::to_string(e.line()) + ", column " +
                                                  std::to_string(e.column()) : "";
        fail("messages", "the model's chat template" + origin + " failed on these messages" + at + ": " + e.message(),
             "chat_template_error");
      }
    } else {
      prompt = plain_chat_template(msgs);
    }
    const size_t end = prompt.find_last_not_of(" \t\r\n");
    r.reasoning_open = end != std::string::npos && end + 1 >= 7 && prompt.compare(end + 1 - 7, 7, "<think>") == 0;
    if (choice == "required" || choice == "function") force_call(lim, r, tools, forced, prompt);
    tokenize_into(prompt, tok, "messages", r.prompt_ids, lim);
    r.prompt_was_text = true;
  }
  const int64_t n = int64_t(r.prompt_ids.size());
  if (n == 0) fail("prompt", "the prompt is empty (it must have at least one token)", "invalid_value");
  if (n >= lim.max_context)
    fail("prompt", "the prompt has " + std::to_string(n) + " tokens; this server's context is " +
                       std::to_string(lim.max_context) + " tokens (leave room for at least one new token)",
         "context_length_exceeded");

  // max_tokens (chat also accepts max_completion_tokens).
  int64_t dflt = ep == Endpoint::Completions ? std::min(lim.default_max_tokens, lim.max_context - n) : lim.max_context - n;
  const char* mt_name = "max_tokens";
  if (ep == Endpoint::ChatCompletions && j.contains("max_completion_tokens") && !j["max_completion_tokens"].is_null())
    mt_name = "max_completion_tokens";
  r.max_tokens = get_int(j, mt_name, 0, std::numeric_limits<int32_t>::max(), dflt);
  if (n + r.max_tokens > lim.max_context)
    fail(mt_name, "prompt (" + std::to_string(n) + " tokens) + " + mt_name + " (" + std::to_string(r.max_tokens) +
                      ") exceeds this server's context of " + std::to_string(lim.max_context) + " tokens",
         "context_length_exceeded");
  return r;
}
}  // namespace

ParsedRequest parse_request(Endpoint ep, const std::string& body, const ParseLimits& lim, const Tokenizer* tok) {
  try {
    return parse_impl(ep, body, lim, tok);
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {  // a safety net: whatever the input, the answer is a 400
    ApiError a;
    a.message = std::string("invalid request: ") + e.what();
    a.code = "invalid_request";
    throw a;
  }
}

int64_t longest_token_bytes(const Tokenizer& tok) {
  size_t longest = 1;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    try {
      longest = std::max(longest, tok.token_bytes(id).size());
    } catch (const Error&) {  // a hole in the ids
    }
  }
  for (const auto& sp : tok.specials()) longest = std::max(longest, sp.text.size());
  return int64_t(longest);
}

}  // namespace k3::serve
