// k3 generate: prefill + KV/state-cached decode with the samplers.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "cli/commands.h"
#include "core/format.h"
#include "core/host_memory.h"
#include "infer/generate.h"
#include "models/registry.h"
#include "tokenizer/bpe.h"

namespace k3::cli {

namespace {
std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) throw error("generate", "--prompt-ids '", s, "' has an empty entry");
    item = item.substr(a, b - a + 1);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size()) throw error("generate", "--prompt-ids: '", item, "' is not an integer token id");
    ids.push_back(v);
  }
  if (ids.empty()) throw error("generate", "--prompt-ids is empty");
  return ids;
}
}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text or token ids with a KV/state cache");
  static std::string model_dir, prompt, prompt_ids;
  static GenerateOptions g;
  static bool print_ids = false, ignore_eos = false, stats = false;
  static std::string dtype = "f32", cache_dtype = "f32", quantize = "none";
  static RuntimeOptions rt;
  cmd->add_option("--model", model_dir, "Hugging Face model folder")->required();
  auto* pt = cmd->add_option("--prompt", prompt, "Prompt text (uses the tokenizer files beside the weights)");
  auto* pi = cmd->add_option("--prompt-ids", prompt_ids, "Prompt as comma-separated token ids, e.g. 5,17,42");
  pt->excludes(pi);
  cmd->add_option("--max-new-tokens", g.max_new_tokens, "Tokens to generate")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", g.sampling.temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  cmd->add_option("--top-k", g.sampling.top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", g.sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--repetition-penalty", g.sampling.repetition_penalty, "HF-style repetition penalty (1 = off)")->capture_default_str();
  cmd->add_option("--seed", g.sampling.seed, "Random seed")->capture_default_str();
  cmd->add_flag("--print-ids", print_ids, "Print prompt + generated ids on the last line of stdout");
  cmd->add_flag("--ignore-eos", ignore_eos, "Keep going past the end-of-text token");
  cmd->add_flag("--stats", stats, "Print prefill/decode speed and the sequence's memory to stderr");
  static std::string speculate = "off";
  cmd->add_option("--speculate", speculate,
                  "Speculative decoding: ngram (prompt lookup: the tokens that followed the last n-gram earlier in "
                  "the sequence are checked in one forward; greedy output is unchanged, sampled output keeps the model's "
                  "distribution), or mtp (drafts from the checkpoint's multi-token-prediction layer, DeepSeek-V3's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"off", "ngram", "mtp"}));
  static std::string draft_model_dir;
  cmd->add_option("--draft-model", draft_model_dir,
                  "Speculative decoding with a smaller model of the same tokenizer (Hugging Face folder): it drafts "
                  "greedily, the model checks its drafts in one forward (the same rule as --speculate)");
  cmd->add_option("--draft-tokens", g.speculate.draft_tokens, "Tokens drafted per check (--speculate, --draft-model)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--dtype", dtype, "GEMM weight storage on CUDA: f32, or bf16 (fp32 accumulation)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  static bool check_weights = false;
  static bool json_object = false;
  static std::string json_schema_file;
  cmd->add_flag("--json", json_object, "Constrain the output to a JSON object (it stops when the object closes)");
  cmd->add_option("--json-schema", json_schema_file,
                  "Constrain the output to instances of this JSON Schema (a file; the subset docs/serving.md names)")
      ->type_name("FILE");
  add_check_weights_option(cmd, check_weights);
  add_cache_dtype_option(cmd, cache_dtype);
  add_quantize_option(cmd, quantize);
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    const WeightStorage storage = weight_storage(dtype, quantize, rt, "generate");
    if (json_object && !json_schema_file.empty()) throw error("generate", "give --json or --json-schema FILE, not both");
    if (json_object) g.json = JsonSchema::any_object();
    if (!json_schema_file.empty()) g.json = JsonSchema::compile(read_json_file(json_schema_file));
    apply_cache_dtype(cache_dtype, rt, "generate");
    if (prompt.empty() && prompt_ids.empty()) throw error("generate", "give --prompt TEXT or --prompt-ids IDS");
    g.sampling.validate();
    g.stop_at_eos = ignore_eos ? StopAtEos::No : StopAtEos::Yes;
    g.speculate.ngram = speculate == "ngram";
    g.speculate.mtp = speculate == "mtp";
    if (speculate != "off" && !draft_model_dir.empty())
      throw error("generate", "give --speculate ", speculate, " or --draft-model, not both");
    // On CUDA each weight goes to the device as it is read, and the context's memories are made there.
    const Device device = rt.device == "cuda" ? Device::CUDA : Device::CPU;
    const auto load_start = std::chrono::steady_clock::now();
    auto model = load_model(model_dir, LoadPlan::inference(device, storage));
    if (stats)
      std::fprintf(stderr, "loaded in %.2f s: weights %s on the %s; peak host memory %s\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(),
                   human_bytes(double(model->weight_bytes())).c_str(), device == Device::CUDA ? "device" : "host",
                   peak_resident_bytes() ? human_bytes(double(*peak_resident_bytes())).c_str() : "unknown");
    if (check_weights) check_weights_finite(*model);
    std::unique_ptr<Model> draft;
    if (!draft_model_dir.empty()) {
      draft = load_model(draft_model_dir, LoadPlan::inference(device, storage));
      if (check_weights) check_weights_finite(*draft);
      g.speculate.draft_model = draft.get();
    }
    std::vector<int64_t> ids;
    std::optional<Tokenizer> tok;
    std::optional<StreamDecoder> stream;
    if (!prompt.empty() || g.json) tok = Tokenizer::from_dir(model_dir);
    if (g.json) g.token_bytes = TokenBytes::of(*tok);
    if (!prompt.empty()) {
      for (int32_t t : tok->encode(prompt)) ids.push_back(t);
      stream.emplace(*tok);
      std::cout << prompt << std::flush;
    } else {
      ids = parse_ids(prompt_ids);
    }
    const bool speculate_any = g.speculate.ngram || g.speculate.mtp || draft;
    GenerateStats st;
    auto out = generate(*model, ids, g, [&](int64_t id) {
      if (stream) std::cout << stream->push(int32_t(id)) << std::flush;
    }, &st);
    if (stream) std::cout << stream->flush() << "\n";
    if (print_ids) {
      for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
      std::cout << "\n";
    }
    if (stats)
      std::fprintf(stderr, "prefill %lld tokens in %.3f s (%.1f tok/s); decode %lld tokens in %.3f s (%.1f tok/s); context memory %zu bytes\n",
                   (long long)st.prompt_tokens, st.prefill_seconds, double(st.prompt_tokens) / std::max(st.prefill_seconds, 1e-9),
                   (long long)st.new_tokens, st.decode_seconds,
                   double(std::max<int64_t>(st.new_tokens - 1, 0)) / std::max(st.decode_seconds, 1e-9), st.context_bytes);
    if (stats && speculate_any)
      std::fprintf(stderr, "speculation: %lld checks, %lld of %lld drafted tokens kept (%.0f%%)\n",
                   (long long)st.verify_steps, (long long)st.accepted, (long long)st.drafted,
                   st.drafted ? 100.0 * double(st.accepted) / double(st.drafted) : 0.0);
    if (stats && speculate_any && st.verify_steps)
      std::fprintf(stderr,
                   "rollback: %.2f ms copying states before checks, %.2f ms re-running %lld kept tokens after "
                   "rejections; keeping every checked position's states instead: ~%.2f ms of copies, no re-runs\n",
                   1e3 * st.mark_seconds, 1e3 * st.rerun_seconds, (long long)st.rerun_tokens,
                   1e3 * st.mark_seconds * double(st.check_tokens) / double(st.verify_steps));
  });
}

}  // namespace k3::cli
