// k3 serve: flags, the model and its tokenizer; the server itself is src/server/.
#include <iostream>

#include "cli/commands.h"
#include "core/error.h"
#include "models/registry.h"
#include "server/http_server.h"
#include "tokenizer/bpe.h"

namespace k3::cli {

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (continuous batching, prefix caching)");
  static serve::ServeOptions o;
  static RuntimeOptions rt;
  static std::string cache_dtype = "f32", dtype = "f32", quantize = "none";
  cmd->add_option("--model", o.model_dir, "Hugging Face model folder")->required();
  cmd->add_option("--host", o.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "Port (0: any free port; the chosen one is printed)")->capture_default_str()->check(CLI::Range(0, 65535));
  cmd->add_option("--max-batch", o.max_batch, "Sequences decoded together")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--ctx", o.ctx, "Tokens per sequence, prompt + completion (0: the model's, at most 2048)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--memory-mb", o.memory_mb, "Budget for running sequences' context memory (admission control)")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--page-tokens", o.page_tokens, "Tokens per page of KV / latent cache taken from the budget")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--cache-mb", o.cache_mb, "Prefix-cache budget (0: no prefix cache)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--cache-host-mb", o.cache_host_mb,
                  "Host-memory tier of the prefix cache: snapshots evicted from --cache-mb move there instead of "
                  "being dropped, and a hit copies them back (for a model on the GPU; 0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--cache-block", o.cache_block, "Snapshot the context every this many prompt tokens (0: no prefix cache)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-step-tokens", o.max_step_tokens,
                  "Tokens one scheduler step computes: the running sequences' decode rows first, then chunks of new "
                  "prompts fill the rest, so a long prompt does not stall the streams (0: prefill each prompt whole; "
                  "else more than --max-batch)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  static std::string speculate = "off";
  cmd->add_option("--speculate", speculate,
                  "Speculative decoding for requests without logprobs: ngram (prompt lookup; each such request checks "
                  "its drafts in one forward of its own instead of a row of the batched step; sampled requests keep "
                  "the target's distribution), or mtp (drafts from the checkpoint's multi-token-prediction layer, "
                  "DeepSeek-V3's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"off", "ngram", "mtp"}));
  static std::string draft_model_dir;
  cmd->add_option("--draft-model", draft_model_dir,
                  "Speculative decoding with a smaller model of the same tokenizer (Hugging Face folder): it drafts "
                  "greedily on a context of its own per request, the model checks the drafts as with --speculate")
      ->type_name("DIR");
  cmd->add_option("--draft-tokens", o.draft_tokens, "Tokens drafted per check (--speculate, --draft-model)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--max-queue", o.max_queue, "Requests allowed to wait; more get 503")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--timeout", o.timeout_s, "Default and maximum per-request time limit, seconds (at most a week)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 7 * 86400.0));
  cmd->add_option("--http-threads", o.http_threads, "HTTP worker threads (0: 2 x max-batch + 64; at most 1024)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--header-timeout", o.header_timeout_s,
                  "Seconds a request's line and headers may take to arrive (slower clients get 408)")
      ->capture_default_str()
      ->check(CLI::Range(0.05, 3600.0));
  cmd->add_option("--body-timeout", o.body_timeout_s, "Seconds a request's body may take to arrive after its headers")
      ->capture_default_str()
      ->check(CLI::Range(0.05, 3600.0));
  cmd->add_option("--max-connections", o.max_connections,
                  "Open connections at most; at the limit the longest-waiting one not being served is dropped")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--served-model-name", o.served_name, "Model id in the API (default: the folder's name)");
  cmd->add_option("--chat-template", o.chat_template_file,
                  "Jinja chat template file for /v1/chat/completions (default: tokenizer_config.json's "
                  "chat_template; without one, plain \"role: content\" lines)")
      ->type_name("FILE");
  static bool check_weights = true;
  add_check_weights_option(cmd, check_weights);
  add_cache_dtype_option(cmd, cache_dtype);
  cmd->add_option("--dtype", dtype, "GEMM weight storage on CUDA: f32, or bf16 (fp32 accumulation)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  add_quantize_option(cmd, quantize);
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    o.speculate_ngram = speculate == "ngram";
    o.speculate_mtp = speculate == "mtp";
    if (speculate != "off" && !draft_model_dir.empty())
      throw error("serve", "give --speculate ", speculate, " or --draft-model, not both");
    if (o.max_step_tokens > 0 && o.max_step_tokens <= o.max_batch)
      throw error("serve", "--max-step-tokens ", o.max_step_tokens, " must exceed --max-batch ", o.max_batch,
                  " (the decode rows come first, the prompts' chunks after them), or be 0");
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    apply_cache_dtype(cache_dtype, rt, "serve");
    const WeightStorage storage = weight_storage(dtype, quantize, rt, "serve");
    const Device device = rt.device == "cuda" ? Device::CUDA : Device::CPU;
    auto model = load_model(o.model_dir, LoadPlan::inference(device, storage));
    if (check_weights) check_weights_finite(*model);
    // On CUDA the weights and every sequence's memories live on the device (mixers_cuda.h); the
    // KV and latent caches are allocated whole for the context there, so the page budget counts
    // less than the device holds.
    std::unique_ptr<Model> draft;
    if (!draft_model_dir.empty()) {
      draft = load_model(draft_model_dir, LoadPlan::inference(device, storage));
      if (check_weights) check_weights_finite(*draft);
      o.draft_model = draft.get();
    }
    std::optional<Tokenizer> tok;
    try {
      tok = Tokenizer::from_dir(o.model_dir);
    } catch (const std::exception& e) {
      std::cerr << "k3 serve: no tokenizer (" << e.what() << "); prompts must be token-id arrays\n";
    }
    if (tok && !model->eos_token_id && tok->eos_id()) model->eos_token_id = *tok->eos_id();
    serve::serve_http(o, std::move(model), std::move(tok));
  });
}

}  // namespace k3::cli
