#include "infer/serve/tool_calls.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <utility>

#include "text/jinja.h"
#include "tokenizer/bpe.h"

namespace k3::serve {

namespace {

const std::string kThinkOpen = "<think>", kThinkClose = "</think>";
// Kimi
const std::string kKimiOpen = "<|tool_calls_section_begin|>", kKimiClose = "<|tool_calls_section_end|>";
const std::string kKimiCall = "<|tool_call_begin|>", kKimiArgs = "<|tool_call_argument_begin|>",
                  kKimiEnd = "<|tool_call_end|>";
// DeepSeek-V3
const std::string kDsOpen = "<｜tool▁calls▁begin｜>", kDsClose = "<｜tool▁calls▁end｜>";
const std::string kDsCall = "<｜tool▁call▁begin｜>", kDsSep = "<｜tool▁sep｜>", kDsEnd = "<｜tool▁call▁end｜>";
// Hermes
const std::string kHermesOpen = "<tool_call>", kHermesClose = "</tool_call>";

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return {};
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// The length of the longest suffix of s that begins `marker` (text to hold back).
size_t partial_suffix(const std::string& s, const std::string& marker) {
  for (size_t k = std::min(marker.size() - 1, s.size()); k > 0; --k)
    if (s.compare(s.size() - k, k, marker, 0, k) == 0) return k;
  return 0;
}

// A JSON object's text, compact with the model's key order; nullopt when it is not one.
std::optional<std::string> object_text(const std::string& text) {
  if (!TemplateJson::accept(text)) return std::nullopt;
  const TemplateJson v = TemplateJson::parse(text);
  if (!v.is_object()) return std::nullopt;
  return v.dump(-1, ' ', false, TemplateJson::error_handler_t::replace);
}

std::string call_id() {
  static std::atomic<uint64_t> counter{0};
  uint64_t x = 0x9E3779B97F4A7C15ull * (++counter) ^ uint64_t(reinterpret_cast<uintptr_t>(&counter));
  std::string id = "call_";
  const char* alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  for (int i = 0; i < 24; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    id += alphabet[(x * 2685821657736338717ull) % 62];
  }
  return id;
}

bool single_token(const Tokenizer& tok, const std::string& text) { return tok.encode(text).size() == 1; }

}  // namespace

const char* tool_format_name(ToolFormat f) {
  switch (f) {
    case ToolFormat::Hermes: return "hermes";
    case ToolFormat::Kimi: return "kimi";
    case ToolFormat::DeepSeek: return "deepseek";
    case ToolFormat::None: break;
  }
  return "none";
}

ToolFormat tool_format_of(const Tokenizer& tok) {
  if (single_token(tok, kKimiOpen) && single_token(tok, kKimiCall)) return ToolFormat::Kimi;
  if (single_token(tok, kDsOpen) && single_token(tok, kDsCall)) return ToolFormat::DeepSeek;
  if (single_token(tok, kHermesOpen) && single_token(tok, kHermesClose)) return ToolFormat::Hermes;
  return ToolFormat::None;
}

std::vector<std::string> output_markers(ToolFormat f) {
  std::vector<std::string> m = {kThinkOpen, kThinkClose};
  switch (f) {
    case ToolFormat::Hermes: m.insert(m.end(), {kHermesOpen, kHermesClose}); break;
    case ToolFormat::Kimi: m.insert(m.end(), {kKimiOpen, kKimiClose, kKimiCall, kKimiArgs, kKimiEnd}); break;
    case ToolFormat::DeepSeek: m.insert(m.end(), {kDsOpen, kDsClose, kDsCall, kDsSep, kDsEnd}); break;
    case ToolFormat::None: break;
  }
  return m;
}

ForcedCall forced_call(ToolFormat f, const std::string& name) {
  switch (f) {
    case ToolFormat::Hermes:
      return {kHermesOpen + "\n{\"name\": " + TemplateJson(name).dump() + ", \"arguments\": ", "}\n" + kHermesClose};
    case ToolFormat::Kimi: return {kKimiOpen + kKimiCall + "functions." + name + ":0" + kKimiArgs, kKimiEnd + kKimiClose};
    case ToolFormat::DeepSeek:
      return {kDsOpen + kDsCall + "function" + kDsSep + name + "\n```json\n", "\n```" + kDsEnd + kDsClose};
    case ToolFormat::None: break;
  }
  return {};
}

ChatOutput::ChatOutput(ToolFormat format, std::vector<std::string> tools, bool reasoning_open, const ForcedCall* forced)
    : format_(format), tools_(std::move(tools)), state_(reasoning_open ? State::Reasoning : State::Start) {
  switch (format_) {
    case ToolFormat::Hermes: open_ = kHermesOpen, close_ = kHermesClose; break;
    case ToolFormat::Kimi: open_ = kKimiOpen, close_ = kKimiClose; break;
    case ToolFormat::DeepSeek: open_ = kDsOpen, close_ = kDsClose; break;
    case ToolFormat::None: tools_.clear(); break;
  }
  if (forced && !tools_.empty()) {
    held_ = forced->open;
    forced_close_ = forced->close;
    forced_ = *forced;
    state_ = State::Section;
  }
}

ChatDelta ChatOutput::push(const std::string& text) {
  ChatDelta d;
  held_ += text;
  run(d, false);
  return d;
}

ChatDelta ChatOutput::finish() {
  ChatDelta d;
  if (state_ == State::Section && !forced_close_.empty()) held_ += std::exchange(forced_close_, std::string());
  run(d, true);
  return d;
}

bool ChatOutput::take_until(const std::string& marker, std::string& to, bool final) {
  const size_t at = held_.find(marker);
  if (at != std::string::npos) {
    to += held_.substr(0, at);
    held_.erase(0, at);
    return true;
  }
  const size_t keep = final ? 0 : partial_suffix(held_, marker);
  to += held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return false;
}

void ChatOutput::run(ChatDelta& d, bool final) {
  for (;;) {
    switch (state_) {
      case State::Start: {
        const size_t lead = held_.find_first_not_of(" \t\r\n");
        if (lead != std::string::npos && held_.compare(lead, kThinkOpen.size(), kThinkOpen) == 0) {
          held_.erase(0, lead + kThinkOpen.size());
          state_ = State::Reasoning;
          continue;
        }
        const std::string rest = lead == std::string::npos ? std::string() : held_.substr(lead);
        if (!final && (lead == std::string::npos || kThinkOpen.compare(0, rest.size(), rest) == 0)) return;
        state_ = State::Content;
        continue;
      }
      case State::Reasoning: {
        if (!take_until(kThinkClose, d.reasoning, final)) return;
        held_.erase(0, kThinkClose.size());
        after_reasoning_ = true;
        state_ = State::Content;
        continue;
      }
      case State::Content: {
        if (after_reasoning_) {  // the answer begins after the blank line that follows the reasoning
          held_.erase(0, std::min(held_.size(), held_.find_first_not_of("\r\n")));
          if (held_.empty() && !final) return;
          after_reasoning_ = false;
        }
        if (tools_.empty()) {
          d.content += std::exchange(held_, std::string());
          return;
        }
        if (!take_until(open_, d.content, final)) return;
        state_ = State::Section;
        continue;
      }
      case State::Section: {
        const size_t end = held_.find(close_, open_.size());
        if (end == std::string::npos) {
          if (!final) return;
          d.content += std::exchange(held_, std::string());  // never closed: the model's text
          state_ = State::Content;
          return;
        }
        const std::string section = held_.substr(0, end + close_.size());
        held_.erase(0, section.size());
        std::vector<ToolCall> calls;
        if (parse_section(section, calls)) {
          calls_ += int64_t(calls.size());
          for (auto& c : calls) d.calls.push_back(std::move(c));
        } else if (forced_) {  // a forced call cut short: the model's own text, without what k3 put around it
          std::string own = section.substr(forced_->open.size());
          if (own.size() >= forced_->close.size() &&
              own.compare(own.size() - forced_->close.size(), forced_->close.size(), forced_->close) == 0)
            own.resize(own.size() - forced_->close.size());
          d.content += own;
        } else {
          d.content += section;
        }
        forced_.reset();
        state_ = State::Content;
        continue;
      }
    }
  }
}

bool ChatOutput::parse_section(const std::string& section, std::vector<ToolCall>& out) const {
  const std::string body = section.substr(open_.size(), section.size() - open_.size() - close_.size());
  auto known = [&](const std::string& name) { return std::find(tools_.begin(), tools_.end(), name) != tools_.end(); };
  if (format_ == ToolFormat::Hermes) {
    const std::string t = trim(body);
    if (!TemplateJson::accept(t)) return false;
    const TemplateJson v = TemplateJson::parse(t);
    if (!v.is_object() || !v.contains("name") || !v["name"].is_string() || !v.contains("arguments")) return false;
    const std::string name = v["name"].get<std::string>();
    const TemplateJson& a = v["arguments"];
    std::optional<std::string> args;
    if (a.is_object()) args = a.dump(-1, ' ', false, TemplateJson::error_handler_t::replace);
    else if (a.is_string()) args = object_text(a.get<std::string>());
    if (!args || !known(name)) return false;
    out.push_back({call_id(), name, *args});
    return true;
  }
  // Kimi and DeepSeek: a run of begin ... end calls, with only whitespace around them.
  const std::string& begin = format_ == ToolFormat::Kimi ? kKimiCall : kDsCall;
  const std::string& sep = format_ == ToolFormat::Kimi ? kKimiArgs : kDsSep;
  const std::string& end = format_ == ToolFormat::Kimi ? kKimiEnd : kDsEnd;
  size_t pos = 0;
  for (;;) {
    const size_t b = body.find_first_not_of(" \t\r\n", pos);
    if (b == std::string::npos) break;
    if (body.compare(b, begin.size(), begin) != 0) return false;
    const size_t s = body.find(sep, b + begin.size()), e = body.find(end, b + begin.size());
    if (s == std::string::npos || e == std::string::npos || s > e) return false;
    const std::string head = trim(body.substr(b + begin.size(), s - b - begin.size()));
    std::string tail = trim(body.substr(s + sep.size(), e - s - sep.size()));
    pos = e + end.size();
    ToolCall c;
    if (format_ == ToolFormat::Kimi) {
      // functions.NAME:INDEX
      std::string name = head.rfind("functions.", 0) == 0 ? head.substr(10) : head;
      if (const size_t colon = name.rfind(':'); colon != std::string::npos) name.resize(colon);
      c.id = head;
      c.name = name;
    } else if (head == "function") {  // V3: NAME\n```json\n{...}\n```
      const size_t nl = tail.find('\n');
      if (nl == std::string::npos) return false;
      c.name = trim(tail.substr(0, nl));
      tail = trim(tail.substr(nl + 1));
      if (tail.rfind("```json", 0) == 0) tail = tail.substr(7);
      else if (tail.rfind("```", 0) == 0) tail = tail.substr(3);
      if (tail.size() >= 3 && tail.compare(tail.size() - 3, 3, "```") == 0) tail.resize(tail.size() - 3);
      tail = trim(tail);
      c.id = call_id();
    } else {  // V3.1: NAME<sep>{...}
      c.name = head;
      c.id = call_id();
    }
    auto args = object_text(tail);
    if (!args || !known(c.name)) return false;
    c.arguments = *args;
    out.push_back(std::move(c));
  }
  return !out.empty();
}

}  // namespace k3::serve
