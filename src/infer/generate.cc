#include "infer/generate.h"

#include <chrono>

namespace k3 {

std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token, GenerateStats* stats) {
  using clock = std::chrono::steady_clock;
  if (prompt.empty()) throw error("generate", "the prompt is empty (give at least one token)");
  if (opts.max_new_tokens < 0) throw error("generate", "max_new_tokens must be >= 0");
  const int64_t V = model.vocab_size();
  for (int64_t id : prompt)
    if (id < 0 || id >= V) throw error("generate", "prompt token id ", id, " is outside the vocabulary [0, ", V, ")");
  const int64_t total = int64_t(prompt.size()) + opts.max_new_tokens;
  if (total > model.max_positions())
    throw error("generate", "prompt (", prompt.size(), ") + max_new_tokens (", opts.max_new_tokens, ") = ", total,
                " exceeds the model's ", model.max_positions(), " positions");
  Sampler sampler(opts.sampling);
  Context ctx = model.new_context(total);
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<int64_t> ids = prompt;
  auto t0 = clock::now();
  // Greedy decoding takes the model's own pick (on the device only the id comes back); a sampler
  // takes the last position's logits. From the third token on each step is one CUDA graph replay
  // where the model's step allows it.
  const bool greedy = sampler.greedy();
  Context* ctxs[1] = {&ctx};
  Decoder decoder(model, {&ctx}, true, greedy ? Decoder::Output::Picks : Decoder::Output::Logits);
  int64_t picked = 0;
  auto step_on = [&](const int64_t* in, int64_t T) {
    if (greedy && T == 1)
      decoder.step(in, &picked);
    else if (T == 1)
      decoder.step(in, logits.data());
    else if (greedy)
      model.greedy(TokenBatch{in, 1, T, ctxs}, &picked);
    else
      model.forward(in, T, &ctx, logits.data(), Logits::Last);
  };
  step_on(prompt.data(), int64_t(prompt.size()));
  auto t1 = clock::now();
  for (int64_t step = 0; step < opts.max_new_tokens; ++step) {
    const int64_t next = greedy ? picked : sampler.sample(logits.data(), V, ids);
    ids.push_back(next);
    if (on_token) on_token(next);
    if (opts.stop_at_eos == StopAtEos::Yes && model.eos_token_id && next == *model.eos_token_id) break;
    if (step + 1 < opts.max_new_tokens) step_on(&next, 1);
  }
  auto t2 = clock::now();
  if (stats) {
    stats->prompt_tokens = int64_t(prompt.size());
    stats->new_tokens = int64_t(ids.size() - prompt.size());
    stats->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    stats->decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    stats->context_bytes = ctx.bytes();
  }
  return ids;
}

}  // namespace k3
