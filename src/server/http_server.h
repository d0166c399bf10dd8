// `k3 serve` as a library: an OpenAI-compatible HTTP server over a loaded model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "models/model.h"
#include "tokenizer/bpe.h"

namespace k3::serve {

struct ServeOptions {
  std::string model_dir, host = "127.0.0.1", served_name, chat_template_file;
  int port = 8080;
  int64_t max_batch = 8, ctx = 0, max_queue = 256, cache_block = 64, page_tokens = 16;
  int64_t max_step_tokens = 512;  // decode rows + prompt chunks per scheduler step (0: whole prompts)
  bool speculate_ngram = false;   // prompt-lookup speculation for requests without logprobs
  bool speculate_mtp = false;     // drafts from the model's multi-token-prediction layer
  const Model* draft_model = nullptr;  // drafts for speculation instead (the caller keeps it alive)
  int64_t draft_tokens = 4;
  double memory_mb = 1024, cache_mb = 256, cache_host_mb = 0, timeout_s = 600;
  int http_threads = 0;
  double header_timeout_s = 10, body_timeout_s = 30;  // a request's head, then its body, must arrive in these
  int64_t max_connections = 4096;
};

// Serves MODEL (and TOK, if any: without one, prompts are token-id arrays) on o.host:o.port until
// SIGINT or SIGTERM, then drains and returns. Prints the address it listens on to stdout.
void serve_http(const ServeOptions& o, std::unique_ptr<Model> model, std::optional<Tokenizer> tok);

}  // namespace k3::serve
