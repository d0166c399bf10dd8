// The OpenAI-compatible HTTP server (on http.h) over the continuous-batching scheduler and the
// state-aware prefix cache of src/infer/serve/: routes, server-sent events, error bodies,
// /metrics text, and the process's signal handling while it listens.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "infer/serve/chat_template.h"
#include "infer/serve/request.h"
#include "infer/serve/response.h"
#include "infer/serve/scheduler.h"
#include "models/registry.h"
#include "server/http.h"
#include "server/http_server.h"
#include "server/text_stream.h"
#include "tokenizer/bpe.h"

namespace k3::serve {

namespace {

using serve::ApiError;
using serve::Endpoint;
using serve::Finish;

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// OpenAI's tool_calls array; streamed deltas number the calls from `first` (-1: a message's, unnumbered).
Json tool_calls_json(const std::vector<serve::ToolCall>& calls, int64_t first) {
  Json out = Json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    Json c = {{"id", calls[k].id},
              {"type", "function"},
              {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
    if (first >= 0) c["index"] = first + int64_t(k);
    out.push_back(std::move(c));
  }
  return out;
}

const char* finish_reason(Finish f) {
  switch (f) {
    case Finish::Eos:
    case Finish::Stop:
    case Finish::Cancelled: return "stop";
    default: return "length";  // Length, Timeout
  }
}

struct HttpStats {
  std::mutex mu;
  std::map<std::string, int64_t> requests;  // by endpoint
  std::map<int, int64_t> errors;            // by HTTP status
  void request(const std::string& ep) {
    std::lock_guard<std::mutex> l(mu);
    requests[ep]++;
  }
  void error(int status) {
    std::lock_guard<std::mutex> l(mu);
    errors[status]++;
  }
};

size_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, rss = 0;
  f >> pages >> rss;
  return rss * size_t(sysconf(_SC_PAGESIZE));
}

// The chat template: --chat-template FILE, else tokenizer_config.json's chat_template; null for the
// plain "role: content" template. A template that does not parse is reported and replaced by the
// plain one instead of stopping the server: completions keep working, and the message says what
// to fix. A --chat-template file that cannot be read stops the server (a typo should not pass).
std::shared_ptr<const serve::ChatFormat> load_chat_format(const ServeOptions& o) {
  const std::string cfg_path = o.model_dir + "/tokenizer_config.json";
  Json cfg = Json::object();
  if (std::filesystem::exists(cfg_path)) {
    try {
      cfg = read_json_file(cfg_path);
    } catch (const std::exception& e) {
      std::cerr << "k3 serve: warning: cannot read " << cfg_path << " (" << e.what() << "); no chat template from it\n";
    }
  }
  std::optional<std::string> source;
  std::string origin;
  if (!o.chat_template_file.empty()) {
    std::ifstream f(o.chat_template_file, std::ios::binary);
    if (!f) throw error("serve", "cannot read the chat template file ", o.chat_template_file);
    std::stringstream ss;
    ss << f.rdbuf();
    source = ss.str();
    origin = o.chat_template_file;
  } else {
    try {
      source = serve::chat_template_source(cfg);
      origin = "tokenizer_config.json";
    } catch (const std::exception& e) {
      std::cerr << "k3 serve: warning: " << e.what() << "; chat prompts use the plain \"role: content\" template\n";
      return nullptr;
    }
  }
  if (!source) {
    std::cerr << "k3 serve: no chat template in the model folder; chat prompts use the plain \"role: content\" "
                 "template (--chat-template FILE gives one)\n";
    return nullptr;
  }
  try {
    auto fmt = std::make_shared<serve::ChatFormat>(serve::ChatFormat{serve::ChatTemplate(*source),
                                                                     serve::special_tokens_of(cfg), origin});
    // A trial render, so that a template needing something k3 lacks shows up now, not per request.
    try {
      fmt->render(serve::TemplateJson::array({{{"role", "user"}, {"content", "Hello"}}}));
    } catch (const serve::TemplateError& e) {
      if (e.kind() != serve::TemplateError::Kind::Raised)
        std::cerr << "k3 serve: warning: the chat template from " << origin
                  << " fails on a one-message conversation: " << e.what()
                  << "\n  chat requests it fails on get a 400 error; --chat-template FILE replaces it\n";
    }
    std::cerr << "k3 serve: chat prompts use the Jinja chat template from " << origin << "\n";
    return fmt;
  } catch (const serve::TemplateError& e) {
    std::cerr << "k3 serve: warning: the chat template from " << origin << " cannot be used: " << e.what()
              << "\n  chat prompts use the plain \"role: content\" template instead; "
                 "--chat-template FILE replaces it\n";
    return nullptr;
  }
}

class Server {
 public:
  Server(const ServeOptions& o, std::unique_ptr<Model> model, std::optional<Tokenizer> tok,
         std::shared_ptr<const serve::ChatFormat> chat)
      : o_(o), model_(std::move(model)), tok_(std::move(tok)) {
    name_ = o.served_name.empty() ? std::filesystem::path(o.model_dir).lexically_normal().filename().string()
                                  : o.served_name;
    if (name_.empty()) name_ = std::filesystem::path(o.model_dir).parent_path().filename().string();
    if (name_.empty()) name_ = "k3";
    lim_.vocab_size = model_->vocab_size();
    lim_.max_context = o.ctx > 0 ? std::min<int64_t>(o.ctx, model_->max_positions()) : std::min<int64_t>(model_->max_positions(), 2048);
    lim_.default_timeout_s = o.timeout_s;
    lim_.max_timeout_s = std::max(o.timeout_s, 1.0);
    if (tok_) lim_.longest_token_bytes = serve::longest_token_bytes(*tok_);
    lim_.chat_format = std::move(chat);
    if (tok_) {
      lim_.tool_format = serve::tool_format_of(*tok_);
      hidden_ = TextAssembler::hidden_specials(*tok_, serve::output_markers(lim_.tool_format));
    }
    serve::SchedulerOptions so;
    so.max_batch = o.max_batch;
    so.context = lim_.max_context;
    so.memory_budget = size_t(o.memory_mb * 1048576.0);
    so.page_tokens = o.page_tokens;
    so.max_queue = o.max_queue;
    so.cache_block = o.cache_block;
    so.cache_budget = size_t(o.cache_mb * 1048576.0);
    so.cache_host_budget = size_t(o.cache_host_mb * 1048576.0);
    so.max_step_tokens = o.max_step_tokens;
    so.speculate_ngram = o.speculate_ngram;
    so.speculate_mtp = o.speculate_mtp;
    so.draft_model = o.draft_model;
    if (tok_) so.token_bytes = TokenBytes::of(*tok_);
    so.draft_tokens = o.draft_tokens;
    sched_ = std::make_unique<serve::Scheduler>(*model_, so);
  }

  void routes(http::Server& svr) {
    http_ = &svr;
    using http::Lane;
    svr.route("GET", "/health", Lane::Inline, [this](const http::Request&, http::Response& res) {
      stats_.request("health");
      res.set_content(dump({{"status", "ok"}, {"model", name_}}), "application/json");
    });
    svr.route("GET", "/v1/models", Lane::Inline, [this](const http::Request&, http::Response& res) {
      stats_.request("models");
      Json m = {{"id", name_}, {"object", "model"}, {"created", started_}, {"owned_by", "k3"},
                {"max_model_len", lim_.max_context}};
      res.set_content(dump({{"object", "list"}, {"data", Json::array({m})}}), "application/json");
    });
    svr.route("GET", "/metrics", Lane::Control, [this](const http::Request&, http::Response& res) {
      stats_.request("metrics");
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    svr.route("POST", "/v1/completions", Lane::Work, [this](const http::Request& req, http::Response& res) {
      generate(Endpoint::Completions, req, res);
    });
    svr.route("POST", "/v1/chat/completions", Lane::Work, [this](const http::Request& req, http::Response& res) {
      generate(Endpoint::ChatCompletions, req, res);
    });
    svr.on_status([this](int status) {
      if (status >= 400) stats_.error(status);
    });
    svr.on_error([](int status, const std::string& message, http::Response& res) {
      ApiError e = http_error(status);
      if (!message.empty()) e.message = message;
      send_error(res, e);
    });
  }

  void stop() { sched_->stop(); }

 private:
  // The body of an error the HTTP layer found (the request line, headers or framing), with a code.
  static ApiError http_error(int status) {
    ApiError e;
    e.status = status;
    switch (status) {
      case 400: e.message = "malformed HTTP request (request line, headers or body framing)", e.code = "bad_request"; break;
      case 404: e.message = "no such endpoint", e.code = "not_found"; break;
      case 405: e.message = "method not allowed", e.code = "method_not_allowed"; break;
      case 408: e.message = "the request was not received in time", e.code = "request_timeout"; break;
      case 413: e.message = "request body too large", e.code = "body_too_large"; break;
      case 414: e.message = "request line too long", e.code = "uri_too_long"; break;
      case 431: e.message = "request headers too large", e.code = "headers_too_large"; break;
      case 500: e.message = "internal error", e.code = "internal_error", e.type = "server_error"; break;
      case 503: e.message = "the server is overloaded", e.code = "overloaded", e.type = "server_error"; break;
      default: e.message = "HTTP error " + std::to_string(status), e.code = "http_error"; break;
    }
    return e;
  }

  static void send_error(http::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(e.body()), "application/json");
  }

  // One choice of a response: its job and what has come of it so far.
  struct Choice {
    Choice(std::shared_ptr<serve::Job> j, TextAssembler t) : job(std::move(j)), text(std::move(t)) {}
    std::shared_ptr<serve::Job> job;
    TextAssembler text;
    std::optional<serve::ChatOutput> split;  // chat: reasoning, content and tool calls
    std::vector<int64_t> ids;              // tokens so far
    std::vector<serve::TokenLogprob> lps;  // their logprobs (requests that asked)
    std::string out;                       // text not sent yet
    bool done = false;                     // the job has ended
    bool started = false, finished = false;  // streaming: the first / the last chunk went out
    bool prompt_scores = false;            // the echoed prompt's logprobs are still to be sent
    size_t text_offset = 0;                // completions logprobs: bytes of text before the next token
    int64_t calls_sent = 0;                // streaming chat: tool calls already sent
    int64_t sent = 0;                      // streaming: tokens already sent
  };

  // Polls every unfinished choice (the first waits up to `wait`); feeds new tokens to the text.
  // True once all are done.
  static bool poll_choices(std::vector<Choice>& cs, std::chrono::milliseconds wait) {
    bool all = true;
    for (auto& c : cs) {
      if (c.done) continue;
      std::vector<int64_t> fresh;
      c.done = c.job->poll(fresh, std::exchange(wait, std::chrono::milliseconds(0)), &c.lps);
      for (int64_t t : fresh) {
        c.ids.push_back(t);
        c.out += c.text.push(t);
        if (c.text.stop_hit) c.job->cancel(Finish::Stop);
      }
      all = all && c.done;
    }
    return all;
  }

  void generate(Endpoint ep, const http::Request& req, http::Response& res) {
    stats_.request(ep == Endpoint::Completions ? "completions" : "chat_completions");
    serve::ParsedRequest pr;
    try {
      pr = serve::parse_request(ep, req.body, lim_, tok_ ? &*tok_ : nullptr);
      if (!pr.model.empty() && pr.model != name_) {
        ApiError e;
        e.status = 404;
        e.message = "the model '" + pr.model + "' does not exist; this server serves '" + name_ + "'";
        e.param = "model";
        e.code = "model_not_found";
        throw e;
      }
      if (sched_->estimate_bytes(int64_t(pr.prompt_ids.size()) + pr.max_tokens) > sched_->options().memory_budget) {
        ApiError e;
        e.message = "prompt + max_tokens need more context memory than this server's budget; lower max_tokens";
        e.param = "max_tokens";
        e.code = "context_length_exceeded";
        throw e;
      }
    } catch (const ApiError& e) {
      send_error(res, e);
      return;
    }
    // One job per choice; choice i samples with seed + i (choice 0 is what n = 1 gives).
    auto cs = std::make_shared<std::vector<Choice>>();
    try {
      for (int64_t i = 0; i < pr.n; ++i) {
        serve::GenParams g;
        g.prompt = pr.prompt_ids;
        g.max_tokens = pr.max_tokens;
        g.sampling = pr.sampling;
        g.sampling.seed = pr.sampling.seed + uint64_t(i);
        g.stop_at_eos = !pr.ignore_eos;
        g.timeout_s = pr.timeout_s;
        g.logprobs = pr.logprobs;
        g.prompt_logprobs = pr.echo && pr.logprobs >= 0;
        g.json = pr.json;
        const bool scored = g.prompt_logprobs;
        cs->emplace_back(sched_->submit(std::move(g)),
                         TextAssembler(tok_ ? &*tok_ : nullptr, model_->eos_token_id, pr.ignore_eos, pr.stop, hidden_));
        cs->back().prompt_scores = scored;
      }
    } catch (const std::exception& e) {
      for (auto& c : *cs) c.job->cancel();
      ApiError a;
      a.status = 503;
      a.type = "server_error";
      a.message = e.what();
      a.code = "overloaded";
      send_error(res, a);
      return;
    }
    const bool chat = ep == Endpoint::ChatCompletions;
    if (chat)
      for (auto& c : *cs) c.split.emplace(lim_.tool_format, pr.tool_names, pr.reasoning_open, pr.forced_call ? &*pr.forced_call : nullptr);
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(++next_id_);
    const int64_t created = int64_t(std::time(nullptr));
    const Tokenizer* tok = tok_ ? &*tok_ : nullptr;
    std::string echo;
    if (pr.echo) {
      echo = pr.prompt_text;
      if (!pr.prompt_was_text && tok) {
        try {
          echo = tok->decode(std::vector<int32_t>(pr.prompt_ids.begin(), pr.prompt_ids.end()));
        } catch (const std::exception&) {  // ids the tokenizer has no bytes for: no echo text
        }
      }
    }
    const int64_t n_prompt = int64_t(pr.prompt_ids.size());
    const std::vector<int64_t> prompt_ids = pr.prompt_ids;
    const int64_t want_lp = pr.logprobs;
    // The logprobs of choice c's tokens from `from` on, after the echoed prompt's if not sent yet.
    auto logprobs = [=](Choice& c, size_t from) -> Json {
      if (want_lp < 0) return nullptr;
      std::vector<serve::TokenLogprob> lps(c.lps.begin() + int64_t(from), c.lps.end());
      if (chat) return {{"content", serve::chat_logprobs(lps, tok)}};
      serve::CompletionLogprobs out(tok, c.text_offset);
      if (std::exchange(c.prompt_scores, false)) {
        out.add_unscored(prompt_ids[0]);
        for (const auto& lp : c.job->prompt_logprobs()) out.add(lp);
      }
      for (const auto& lp : lps) out.add(lp);
      c.text_offset = out.text_offset();
      return out.json();
    };
    auto usage = [cs, n_prompt] {
      int64_t completion = 0, cached = 0;
      for (const auto& c : *cs) {
        completion += int64_t(c.ids.size());
        cached = std::max(cached, c.job->cached_tokens());
      }
      return Json{{"prompt_tokens", n_prompt},
                  {"completion_tokens", completion},
                  {"total_tokens", n_prompt + completion},
                  {"prompt_tokens_details", {{"cached_tokens", cached}}}};
    };
    auto failed = [](const Choice& c) { return !c.text.stop_hit && c.job->finish() == Finish::Error; };
    auto generation_error = [](const Choice& c) {
      ApiError e;
      e.status = 500;
      e.type = "server_error";
      e.message = "generation failed: " + c.job->error();
      return e;
    };

    if (!pr.stream) {
      // The answer is one plain JSON body (a late error keeps its 500); meanwhile the connection
      // is watched so that a client that leaves cancels its request (streams notice it on write).
      while (!poll_choices(*cs, std::chrono::milliseconds(50)))
        if (req.client_gone())
          for (auto& c : *cs) c.job->cancel();
      Json choices = Json::array();
      for (size_t i = 0; i < cs->size(); ++i) {
        Choice& c = (*cs)[i];
        if (failed(c)) return send_error(res, generation_error(c));
        std::string out = c.out + c.text.finish();
        Finish f = c.text.stop_hit ? Finish::Stop : c.job->finish();
        Json choice = {{"index", i}, {"finish_reason", finish_reason(f)}, {"token_ids", c.ids}};
        choice["logprobs"] = logprobs(c, 0);
        if (chat) {
          serve::ChatDelta d = c.split->push(out);
          d.append(c.split->finish());
          Json msg = {{"role", "assistant"}, {"content", d.content}};
          if (!d.reasoning.empty()) msg["reasoning_content"] = d.reasoning;
          if (!d.calls.empty()) {
            if (d.content.empty()) msg["content"] = nullptr;
            msg["tool_calls"] = tool_calls_json(d.calls, -1);
            choice["finish_reason"] = "tool_calls";
          }
          choice["message"] = std::move(msg);
        } else {
          choice["text"] = echo + out;
        }
        if (f == Finish::Timeout) choice["k3_finish"] = "timeout";
        choices.push_back(std::move(choice));
      }
      Json body = {{"id", id},
                   {"object", chat ? "chat.completion" : "text_completion"},
                   {"created", created},
                   {"model", name_},
                   {"choices", choices},
                   {"usage", usage()}};
      res.set_content(dump(body), "application/json");
      return;
    }

    // Streaming: server-sent events, one chunk per choice per token batch, then [DONE].
    struct StreamState {
      std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
    };
    auto st = std::make_shared<StreamState>();
    const bool include_usage = pr.include_usage;
    const std::string model_name = name_;
    auto event = [=](Json choices, Json usage_json) {
      Json body = {{"id", id},
                   {"object", chat ? "chat.completion.chunk" : "text_completion"},
                   {"created", created},
                   {"model", model_name},
                   {"choices", std::move(choices)}};
      if (!usage_json.is_null()) body["usage"] = std::move(usage_json);
      return "data: " + dump(body) + "\n\n";
    };
    // The chunk of choice i with its tokens since the last one; finish: null or the reason.
    auto chunk = [=](size_t i, const std::string& piece, const char* finish, bool timed_out = false) {
      Choice& c = (*cs)[i];
      const bool first = !std::exchange(c.started, true);
      const size_t from = size_t(c.sent);
      c.sent = int64_t(c.ids.size());
      Json ch = {{"index", i}, {"finish_reason", finish ? Json(finish) : Json(nullptr)}};
      if (timed_out) ch["k3_finish"] = "timeout";  // as the non-streamed reply says it
      ch["logprobs"] = logprobs(c, from);
      ch["token_ids"] = std::vector<int64_t>(c.ids.begin() + int64_t(from), c.ids.end());
      if (chat) {
        Json delta = Json::object();
        if (first) delta["role"] = "assistant";
        serve::ChatDelta d = c.split->push(piece);
        if (finish) d.append(c.split->finish());
        if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
        if (!d.content.empty() || (!finish && d.empty())) delta["content"] = d.content;
        if (!d.calls.empty()) {
          delta["tool_calls"] = tool_calls_json(d.calls, c.calls_sent);
          c.calls_sent += int64_t(d.calls.size());
        }
        if (finish && c.split->called()) ch["finish_reason"] = "tool_calls";
        ch["delta"] = delta;
      } else {
        ch["text"] = (first ? echo : std::string()) + piece;
      }
      return event(Json::array({ch}), nullptr);
    };
    res.set_stream(
        "text/event-stream",
        [=](http::Sink& sink) {
          if (sink.client_gone()) {  // noticed before a write would fail
            for (auto& c : *cs) c.job->cancel();
            return false;
          }
          auto write = [&](const std::string& s) {
            st->last_write = std::chrono::steady_clock::now();
            if (sink.write(s)) return true;
            for (auto& c : *cs) c.job->cancel();  // the client went away
            return false;
          };
          const bool all_done = poll_choices(*cs, std::chrono::milliseconds(100));
          bool wrote = false;
          for (size_t i = 0; i < cs->size(); ++i) {
            Choice& c = (*cs)[i];
            if (size_t(c.sent) < c.ids.size()) {
              if (!write(chunk(i, std::exchange(c.out, std::string()), nullptr))) return false;
              wrote = true;
            }
            if (!c.done || std::exchange(c.finished, true)) continue;
            if (failed(c)) {
              if (!write("data: " + dump(generation_error(c).body()) + "\n\n")) return false;
            } else {
              const std::string tail = std::exchange(c.out, std::string()) + c.text.finish();
              Finish f = c.text.stop_hit ? Finish::Stop : c.job->finish();
              if (!write(chunk(i, tail, finish_reason(f), f == Finish::Timeout))) return false;
            }
            wrote = true;
          }
          if (!all_done) {
            if (!wrote && std::chrono::steady_clock::now() - st->last_write > std::chrono::seconds(1))
              if (!write(": keep-alive\n\n")) return false;  // also notices a client that left while queued
            return true;
          }
          if (include_usage && !write(event(Json::array(), usage()))) return false;
          if (!write("data: [DONE]\n\n")) return false;
          sink.done();
          return true;
        },
        [cs](bool success) {
          if (!success)
            for (auto& c : *cs) c.job->cancel();
        });
  }

  std::string metrics_text() {
    auto m = sched_->metrics();
    std::ostringstream o;
    auto metric = [&](const char* name, const char* type, const char* help) {
      o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
    };
    auto value = [&](const char* name, const char* type, const char* help, auto v) {  // one unlabelled sample
      metric(name, type, help);
      o << name << " " << v << "\n";
    };
    auto by_kind = [&](const char* name, const char* type, const char* help, auto get) {  // one sample per MemoryKind
      metric(name, type, help);
      for (size_t k = 0; k < 4; ++k) o << name << "{kind=\"" << memory_kind_name(MemoryKind(k)) << "\"} " << get(k) << "\n";
    };
    {
      std::lock_guard<std::mutex> l(stats_.mu);
      metric("k3_http_requests_total", "counter", "HTTP requests by endpoint");
      for (auto& [k, v] : stats_.requests) o << "k3_http_requests_total{endpoint=\"" << k << "\"} " << v << "\n";
      metric("k3_http_errors_total", "counter", "HTTP error responses by status");
      for (auto& [k, v] : stats_.errors) o << "k3_http_errors_total{status=\"" << k << "\"} " << v << "\n";
    }
    value("k3_requests_submitted_total", "counter", "Generation requests accepted into the queue", m.submitted);
    value("k3_requests_rejected_total", "counter", "Generation requests refused (queue full, over budget)", m.rejected);
    metric("k3_requests_finished_total", "counter", "Generation requests finished, by reason");
    for (int f = 1; f < 7; ++f)
      o << "k3_requests_finished_total{reason=\"" << serve::finish_name(Finish(f)) << "\"} " << m.finished[f] << "\n";
    value("k3_prompt_tokens_total", "counter", "Prompt tokens received", m.prompt_tokens);
    value("k3_prefill_tokens_total", "counter", "Prompt tokens computed (not served from the prefix cache)",
          m.prefill_tokens);
    value("k3_generation_tokens_total", "counter", "Tokens generated", m.generated_tokens);
    value("k3_generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s",
          m.tokens_per_second);
    value("k3_queue_depth", "gauge", "Requests waiting for admission", m.queue_depth);
    value("k3_active_sequences", "gauge", "Sequences in the running batch", m.active);
    value("k3_prefilling_sequences", "gauge", "Admitted sequences whose prompt is still being prefilled (in chunks)",
          m.prefilling);
    value("k3_decode_steps_total", "counter", "Batched decode steps", m.decode_steps);
    value("k3_decode_batch_rows_total", "counter", "Sequences summed over decode steps (rows / steps = mean batch)",
          m.decode_rows);
    value("k3_speculation_checks_total", "counter", "Speculative checks run (--speculate, --draft-model)",
          m.spec_checks);
    value("k3_speculation_drafted_tokens_total", "counter", "Draft tokens proposed to the checks", m.spec_drafted);
    value("k3_speculation_accepted_tokens_total", "counter", "Draft tokens the checks kept", m.spec_accepted);
    value("k3_decode_steps_replayed_total", "counter",
          "Decode steps replayed as one CUDA graph (batches that stay the same sequences)", m.replayed_steps);
    metric("k3_time_to_first_token_seconds", "summary", "Submit to first token");
    o << "k3_time_to_first_token_seconds_sum " << m.ttft_sum_s << "\nk3_time_to_first_token_seconds_count "
      << m.ttft_count << "\n";
    value("k3_preemptions_total", "counter", "Sequences sent back to the queue when pages ran out", m.preemptions);
    value("k3_recomputed_tokens_total", "counter", "Tokens run again to rebuild preempted sequences", m.recomputed_tokens);
    value("k3_memory_budget_bytes", "gauge", "Context memory budget for admission", m.memory.budget);
    value("k3_memory_reserved_bytes", "gauge", "Context memory held by admitted sequences (pages + fixed memories)",
          m.memory.used);
    metric("k3_memory_kind_reserved_bytes", "gauge", "Context memory held by admitted sequences, by memory kind");
    for (size_t k = 0; k < 4; ++k)
      o << "k3_memory_kind_reserved_bytes{kind=\"" << memory_kind_name(MemoryKind(k)) << "\"} " << m.memory.bytes_used[k]
        << "\n";
    value("k3_memory_page_tokens", "gauge", "Tokens per page of a growing memory (KV cache, latent cache)",
          m.memory.page_tokens);
    metric("k3_memory_pages", "gauge", "Pages of each growing memory kind: held by admitted sequences, and free");
    for (size_t k = 0; k < 4; ++k) {
      if (m.memory.page_bytes[k] == 0) continue;
      const std::string kind(memory_kind_name(MemoryKind(k)));
      o << "k3_memory_pages{kind=\"" << kind << "\",state=\"used\"} " << m.memory.pages_used[k] << "\n";
      o << "k3_memory_pages{kind=\"" << kind << "\",state=\"free\"} " << m.memory.pages_free[k] << "\n";
    }
    by_kind("k3_context_memory_bytes", "gauge", "Memory of the running sequences' contexts, by memory kind",
            [&](size_t k) { return m.active_bytes_by_kind[k]; });
    by_kind("k3_prefix_cache_bytes", "gauge", "Prefix-cache snapshot memory, by memory kind",
            [&](size_t k) { return m.cache.bytes_by_kind[k]; });
    value("k3_prefix_cache_lookups_total", "counter", "Prefix-cache lookups (prompts longer than one block)",
          m.cache.lookups);
    value("k3_prefix_cache_hits_total", "counter", "Prefix-cache lookups that resumed from a snapshot", m.cache.hits);
    value("k3_prefix_cache_hit_rate", "gauge", "hits / lookups", m.cache.hit_rate());
    by_kind("k3_prefix_cache_hits_by_kind_total", "counter", "Hits that restored memories of each kind",
            [&](size_t k) { return m.cache.hits_by_kind[k]; });
    by_kind("k3_prefix_cache_hit_rate_by_kind", "gauge", "Hits that restored memories of each kind / lookups",
            [&](size_t k) { return m.cache.lookups ? double(m.cache.hits_by_kind[k]) / double(m.cache.lookups) : 0.0; });
    by_kind("k3_prefix_cache_restored_bytes_total", "counter", "Bytes restored from snapshots by hits, by memory kind",
            [&](size_t k) { return m.cache.restored_bytes_by_kind[k]; });
    value("k3_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from snapshots", m.cache.hit_tokens);
    value("k3_prefix_cache_entries", "gauge", "Snapshots held", m.cache.entries);
    value("k3_prefix_cache_kept_entries", "gauge", "Snapshots that have served a hit (evicted last)", m.cache.kept);
    value("k3_prefix_cache_evictions_total", "counter", "Snapshots evicted (LRU, byte budget)", m.cache.evictions);
    value("k3_prefix_cache_host_bytes", "gauge", "Snapshot memory in the host tier (--cache-host-mb)", m.cache.host_bytes);
    value("k3_prefix_cache_host_entries", "gauge", "Snapshots in the host tier", m.cache.host_entries);
    value("k3_prefix_cache_spills_total", "counter", "Snapshots moved to the host tier instead of being dropped",
          m.cache.spills);
    value("k3_prefix_cache_host_hits_total", "counter", "Hits served from the host tier (copied back to the device)",
          m.cache.host_hits);
    value("k3_process_resident_bytes", "gauge", "Resident set size of the server process", resident_bytes());
    if (http_) {
      const auto hc = http_->counters();
      value("k3_http_connections", "gauge", "Open client connections", hc.connections);
      value("k3_http_connections_busy", "gauge", "Connections whose request a handler is serving", hc.busy);
      value("k3_http_buffered_request_bytes", "gauge", "Request bytes held while requests arrive or are served",
            hc.buffered_bytes);
      value("k3_http_connections_accepted_total", "counter", "Connections accepted", hc.accepted);
      value("k3_http_connections_evicted_total", "counter",
            "Waiting connections dropped to make room at the connection limit", hc.evicted);
      value("k3_http_requests_timed_out_total", "counter", "Requests whose head or body did not arrive in time",
            hc.timed_out);
      value("k3_http_connections_refused_total", "counter", "Connections refused because every slot was serving",
            hc.refused);
    }
    return o.str();
  }

  ServeOptions o_;
  std::unique_ptr<Model> model_;
  std::optional<Tokenizer> tok_;
  std::shared_ptr<const std::unordered_set<int64_t>> hidden_;  // special tokens left out of the text
  std::string name_;
  serve::ParseLimits lim_;
  std::unique_ptr<serve::Scheduler> sched_;
  HttpStats stats_;
  http::Server* http_ = nullptr;
  std::atomic<int64_t> next_id_{0};
  int64_t started_ = int64_t(std::time(nullptr));
};

}  // namespace

void serve_http(const ServeOptions& o, std::unique_ptr<Model> model, std::optional<Tokenizer> tok) {
  auto chat = load_chat_format(o);
  // Signals are taken by one thread (sigwait), which stops the server cleanly.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Request buffers of a megabyte or more come from (and go back to) the kernel at once, so that a
  // burst of large bodies leaves no heap behind; and as many connections as the process may open.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  rlimit fl{};
  if (getrlimit(RLIMIT_NOFILE, &fl) == 0 && fl.rlim_cur < fl.rlim_max) {
    fl.rlim_cur = fl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &fl);
  }
  getrlimit(RLIMIT_NOFILE, &fl);

  Server server(o, std::move(model), std::move(tok), std::move(chat));
  http::Limits lim;
  lim.work_threads = o.http_threads > 0 ? o.http_threads : int(std::min<int64_t>(1024, 2 * o.max_batch + 64));
  lim.header_timeout_s = o.header_timeout_s;
  lim.body_timeout_s = o.body_timeout_s;
  lim.max_connections = size_t(std::min<int64_t>(o.max_connections, int64_t(fl.rlim_cur) - 64));
  http::Server svr(lim);
  server.routes(svr);
  const int port = svr.bind(o.host, o.port);
  std::atomic<bool> stopping{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (!stopping) std::cerr << "k3 serve: signal " << sig << ", stopping\n";
    svr.stop();
  });
  std::cout << "k3 serve: listening on http://" << o.host << ":" << port << std::endl;
  svr.run();
  stopping = true;
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  server.stop();
}

}  // namespace k3::serve
