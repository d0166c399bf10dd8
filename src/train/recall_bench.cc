#include "train/recall_bench.h"
#include "core/random.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "models/registry.h"
#include "ops/autograd.h"
#include "train/optimizer.h"
#include "train/plot.h"

namespace k3 {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

constexpr int64_t kLayers = 2, kHeads = 2;

// GPT-2 (learned positions, pre-LN, GELU MLP), as presets.cc's gpt2_config, plus the short conv 4
// (+ SiLU) over q | k | v that the fla models have, so that the mixers differ only in their memory.
Json softmax_config(int64_t vocab, int64_t positions, int64_t d) {
  return Json{{"model_type", "gpt2"},   {"architectures", {"GPT2LMHeadModel"}}, {"k3_short_conv", 4},
              {"vocab_size", vocab},    {"n_positions", positions},
              {"n_embd", d},            {"n_layer", kLayers},
              {"n_head", kHeads},       {"n_inner", nullptr},
              {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"},
              {"tie_word_embeddings", true}};
}

// flash-linear-attention-style model (presets.cc's fla_config): one mixer kind, SwiGLU MLPs.
Json fla_style_config(const std::string& type, int64_t vocab, int64_t d) {
  Json j = {{"model_type", type},       {"vocab_size", vocab},        {"hidden_size", d},
            {"num_hidden_layers", kLayers}, {"num_heads", kHeads},    {"head_dim", d / kHeads},
            {"intermediate_size", 3 * d},   {"conv_size", 4},         {"use_short_conv", true},
            {"norm_eps", 1e-6},             {"tie_word_embeddings", false}};
  if (type == "linear_attn") j["feature_map"] = "elu";
  if (type == "kda") j["lower_bound"] = -5.0;
  // No output gate for GDN and KDA, as DeltaNet has none: the mixers differ in memory only. (With
  // its sigmoid gate KDA stays on the MQAR plateau at T 256 / 32 pairs for 5,000 steps: 0.13.)
  if (type == "gated_deltanet" || type == "kda") j["use_gate"] = false;
  return j;
}

// Kimi K3 in miniature (presets.cc's kimi_small_config with k3 = true): layer 1 KDA (full-rank
// gate, -5 bound), layer 2 gated MLA, both dense (first_k_dense_replace = 2: no MoE layer),
// SiTU MLPs, AttnRes blocks of 2.
Json k3_hybrid_config(int64_t vocab, int64_t positions, int64_t d) {
  const int64_t hd = d / kHeads;
  Json text = {{"model_type", "kimi_linear"},
               {"vocab_size", vocab},
               {"hidden_size", d},
               {"num_hidden_layers", kLayers},
               {"max_position_embeddings", positions},
               {"rms_norm_eps", 1e-5},
               {"hidden_act", "situ"},
               {"activation_situ_beta", 4.0},
               {"activation_situ_linear_beta", 25.0},
               {"intermediate_size", 3 * d},
               {"first_k_dense_replace", kLayers},
               {"moe_layer_freq", 1},
               {"num_attention_heads", kHeads},
               {"num_key_value_heads", kHeads},
               {"q_lora_rank", d / 2},
               {"kv_lora_rank", d / 4},
               {"qk_nope_head_dim", hd},
               {"qk_rope_head_dim", hd / 2},
               {"v_head_dim", hd},
               {"mla_use_nope", true},
               {"mla_use_output_gate", true},
               {"attn_res_block_size", 2},
               {"tie_word_embeddings", false},
               {"linear_attn_config",
                {{"num_heads", kHeads},
                 {"head_dim", hd},
                 {"short_conv_kernel_size", 4},
                 {"use_full_rank_gate", true},
                 {"gate_lower_bound", -5.0},
                 {"kda_layers", {1}},
                 {"full_attn_layers", {2}}}}};
  return Json{{"model_type", "kimi_k3"}, {"architectures", {"KimiK3ForConditionalGeneration"}},
              {"tie_word_embeddings", false}, {"text_config", text}};
}

// Gated DeltaNet's decay g = −exp(A_log) · softplus(a + dt_bias) starts, with fla's dt in
// [1e-3, 1e-1], by forgetting a token within ~10 steps, while KDA's lower-bound gate starts with
// almost no forgetting. In a few thousand AdamW steps GDN cannot unlearn that (dt_bias moves by
// about lr per step) and stays on the MQAR plateau. The suite starts it with slow forgetting too,
// dt in [1e-4, 1e-3] (half-life of 40 tokens or more): both gated mixers then start where
// DeltaNet does and learn when to forget.
void slow_forgetting_init(const Model& m, uint64_t seed) {
  Rng rng(seed ^ 0x9e3779b9u);
  m.visit([&](const std::string& name, Node& p, ParamKind) {
    if (!name.ends_with("dt_bias")) return;
    float* w = p.value.f32();
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      const float dt = std::exp(std::log(1e-4f) + rng.uniform() * (std::log(1e-3f) - std::log(1e-4f)));
      w[i] = dt + std::log(-std::expm1(-dt));  // softplus(w) = dt
    }
  });
}

std::string fmt_g(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

std::string half_loss_text(int64_t step) {
  return step >= 0 ? "loss halved at step " + std::to_string(step) : "loss never halved";
}

// The table's cell: when the best lr's run halved its loss.
std::string half_loss_cell(const RecallResult& r) {
  const RecallRun* best = r.best_run();
  if (!best) return "-";
  return best->half_loss_step >= 0 ? std::to_string(best->half_loss_step) : "never";
}

// The training loss as the progress line shows it, smoothed over steps (half_loss_step reads the
// same curve).
double smoothed_loss(double avg, double loss, size_t step) { return step == 0 ? loss : 0.9 * avg + 0.1 * loss; }

void write_text(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
    if (!out) throw error("recall", "cannot write ", tmp);
  }
  std::filesystem::rename(tmp, path);
}

// Accuracy of greedy predictions at the answer positions of `n` examples of the stream `seed`.
double evaluate(const Model& model, const RecallTaskOptions& task, uint64_t seed, int64_t n) {
  const int64_t chunk = 16, V = model.vocab_size();
  int64_t right = 0, total = 0;
  std::vector<float> logits;
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t B = std::min(chunk, n - first);
    RecallBatch b = make_recall_batch(task, seed, uint64_t(first), B);
    logits.resize(static_cast<size_t>(B * b.T * V));
    model.logits(TokenBatch{b.ids.data(), B, b.T, nullptr}, logits.data(), Logits::All);
    for (size_t i = 0; i < b.targets.size(); ++i) {
      if (b.targets[i] < 0) continue;
      const float* row = logits.data() + i * size_t(V);
      const int64_t pred = int64_t(std::max_element(row, row + V) - row);
      right += pred == b.targets[i];
      ++total;
    }
  }
  return total ? double(right) / double(total) : 0.0;
}

RecallRun train_once(const RecallBenchOptions& o, const Json& config, float lr) {
  RecallRun run;
  run.lr = lr;
  auto model = build_model(config, "recall-" + o.mixer);
  model->init_random(o.seed);
  if (o.mixer == "gdn") slow_forgetting_init(*model, o.seed);
  move_to(*model, o.cuda ? Device::CUDA : Device::CPU);
  AdamWOptions ao;
  ao.lr = lr;
  ao.weight_decay = o.weight_decay;
  AdamW opt(ao);
  const int64_t warmup = int64_t(double(o.warmup_frac) * double(o.steps));
  LrSchedule sched{lr, 0.1f, warmup, o.steps};
  const uint64_t train_seed = recall_train_seed(o.seed);
  auto t0 = clock_type::now();
  double avg = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    RecallBatch b = make_recall_batch(o.task, train_seed, uint64_t(step * o.batch), o.batch);
    zero_grad(*model);
    double loss;
    {
      Recording rec;
      Var l = model->loss(TokenBatch{b.ids.data(), b.B, b.T, nullptr}, b.targets);
      backward(l);
      loss = l->value.to_device(Device::CPU).f32()[0];
    }
    if (!std::isfinite(loss)) throw error("recall", o.mixer, ": the loss became ", loss, " at step ", step, " (lr ", lr, ")");
    clip_grad_norm(*model, 1.0);
    opt.step(*model, sched.at(step));
    model->after_step();
    run.loss_curve.push_back(loss);
    avg = smoothed_loss(avg, loss, size_t(step));
    const bool last = step + 1 == o.steps;
    if (!o.quiet && ((step + 1) % o.log_every == 0 || last)) {
      const double el = seconds_since(t0);
      std::fprintf(stderr, "  [%s %s lr %g] step %lld/%lld loss %.4f | %.1fs (ETA %.0fs)\n", o.mixer.c_str(),
                   recall_task_name(o.task.task).c_str(), double(lr), (long long)(step + 1), (long long)o.steps, avg,
                   el, el / double(step + 1) * double(o.steps - step - 1));
      std::fflush(stderr);
    }
  }
  run.final_train_loss = avg;
  run.half_loss_step = half_loss_step(run.loss_curve);
  run.train_seconds = seconds_since(t0);
  if (o.cuda) move_to(*model, Device::CPU);
  run.accuracy = evaluate(*model, o.task, recall_test_seed(o.seed), o.test_examples);
  return run;
}

}  // namespace

int64_t half_loss_step(const std::vector<double>& loss_curve) {
  if (loss_curve.empty()) return -1;
  const double half = 0.5 * loss_curve[0];
  double avg = 0;
  for (size_t i = 0; i < loss_curve.size(); ++i) {
    avg = smoothed_loss(avg, loss_curve[i], i);
    if (avg < half) return int64_t(i) + 1;
  }
  return -1;
}

const std::vector<std::string>& recall_mixers() {
  static const std::vector<std::string> m = {"softmax", "linear", "deltanet", "gdn", "kda", "k3-hybrid"};
  return m;
}

Json recall_model_config(const std::string& mixer, int64_t vocab, int64_t seq_len, int64_t d_model) {
  if (d_model % kHeads != 0 || d_model < 2 * kHeads)
    throw error("recall", "--d-model ", d_model, " must be an even number >= ", 2 * kHeads);
  const int64_t positions = std::max<int64_t>(seq_len, 64);
  if (mixer == "softmax") return softmax_config(vocab, positions, d_model);
  if (mixer == "linear") return fla_style_config("linear_attn", vocab, d_model);
  if (mixer == "deltanet") return fla_style_config("delta_net", vocab, d_model);
  if (mixer == "gdn") return fla_style_config("gated_deltanet", vocab, d_model);
  if (mixer == "kda") return fla_style_config("kda", vocab, d_model);
  if (mixer == "k3-hybrid") {
    if (d_model % 8 != 0) throw error("recall", "k3-hybrid needs --d-model divisible by 8 (MLA ranks d/4, rope d/4)");
    return k3_hybrid_config(vocab, positions, d_model);
  }
  throw error("recall", "unknown mixer '", mixer, "' (softmax, linear, deltanet, gdn, kda, k3-hybrid)");
}

int64_t default_recall_steps(RecallTask t) {
  switch (t) {
    case RecallTask::Mqar: return 1500;
    case RecallTask::Palindrome: return 1500;
    case RecallTask::Stack: return 1500;
    case RecallTask::Overwrite: return 1500;
    case RecallTask::Capacity: return 1500;
    case RecallTask::Niah: return 1500;
  }
  return 1500;
}

float default_recall_lr(const std::string& mixer) {
  // Softmax attention stays on the MQAR plateau at 3e-3 for the whole CPU budget and leaves it
  // at 1e-2; the delta-rule family stalls at 1e-2 (recall_tasks.md has the sweep).
  if (mixer == "softmax") return 1e-2f;
  return 3e-3f;
}

int64_t recall_state_elements(const Json& config, int64_t seq_len) {
  auto model = build_model(config, "recall-state");
  double bytes = 0;
  for (const LayerMemory& lm : model->memory_layers()) {
    if (lm.spec.kind == MemoryKind::ConvTail) continue;
    bytes += lm.spec.fixed_bytes + lm.spec.per_token_bytes * double(seq_len);
  }
  return int64_t(std::llround(bytes / double(sizeof(float))));
}

const RecallRun* RecallResult::best_run() const {
  for (const RecallRun& r : runs)
    if (r.lr == best_lr) return &r;
  return nullptr;
}

Json RecallResult::to_json() const {
  Json runs_j = Json::array();
  for (const auto& r : runs)
    runs_j.push_back({{"lr", r.lr},
                      {"accuracy", r.accuracy},
                      {"final_train_loss", r.final_train_loss},
                      {"half_loss_step", r.half_loss_step >= 0 ? Json(r.half_loss_step) : Json(nullptr)},
                      {"train_seconds", r.train_seconds}});
  std::vector<double> lrs(options.lrs.begin(), options.lrs.end());
  const RecallRun* best = best_run();
  const Json half = best && best->half_loss_step >= 0 ? Json(best->half_loss_step) : Json(nullptr);
  return Json{{"accuracy", accuracy},
              {"half_loss_step", half},
              {"task", recall_task_name(options.task.task)},
              {"mixer", options.mixer},
              {"seq_len", options.task.seq_len},
              {"pairs", options.task.pairs},
              {"vocab", options.task.vocab},
              {"power_a", options.task.power_a},
              {"d_model", options.d_model},
              {"layers", kLayers},
              {"heads", kHeads},
              {"state_elements", state_elements},
              {"params", params},
              {"steps", options.steps},
              {"batch", options.batch},
              {"lrs", lrs},
              {"best_lr", best_lr},
              {"weight_decay", options.weight_decay},
              {"warmup_frac", options.warmup_frac},
              {"test_examples", options.test_examples},
              {"seed", options.seed},
              {"device", options.cuda ? "cuda" : "cpu"},
              {"train_seconds", train_seconds},
              {"runs", runs_j},
              {"model_config", recall_model_config(options.mixer, options.task.vocab, options.task.seq_len, options.d_model)}};
}

RecallResult run_recall_bench(RecallBenchOptions o) {
  o.task = resolved(o.task);
  if (o.steps <= 0) o.steps = default_recall_steps(o.task.task);
  if (o.batch <= 0) throw error("recall", "--batch must be positive");
  if (o.lrs.empty()) o.lrs = {default_recall_lr(o.mixer)};
  if (o.test_examples <= 0) throw error("recall", "test examples must be positive");
  const Json config = recall_model_config(o.mixer, o.task.vocab, o.task.seq_len, o.d_model);
  RecallResult res;
  res.options = o;
  res.state_elements = recall_state_elements(config, o.task.seq_len);
  {
    auto m = build_model(config, "recall-" + o.mixer);
    res.params = m->total_params();
  }
  if (!o.quiet)
    std::fprintf(stderr, "recall: %s on %s, seq-len %lld, pairs %lld, vocab %lld, d_model %lld, %lld params, state %lld elements, %lld steps x batch %lld\n",
                 o.mixer.c_str(), recall_task_name(o.task.task).c_str(), (long long)o.task.seq_len, (long long)o.task.pairs,
                 (long long)o.task.vocab, (long long)o.d_model, (long long)res.params, (long long)res.state_elements,
                 (long long)o.steps, (long long)o.batch);
  res.accuracy = -1;
  for (float lr : o.lrs) {
    RecallRun r = train_once(o, config, lr);
    if (!o.quiet)
      std::fprintf(stderr, "  [%s lr %g] held-out accuracy %.4f (%.1fs; %s)\n", o.mixer.c_str(), double(lr), r.accuracy,
                   r.train_seconds, half_loss_text(r.half_loss_step).c_str());
    res.train_seconds += r.train_seconds;
    if (r.accuracy > res.accuracy) {
      res.accuracy = r.accuracy;
      res.best_lr = lr;
    }
    res.runs.push_back(std::move(r));
  }
  return res;
}

std::string recall_table_markdown(const std::vector<RecallResult>& results) {
  std::ostringstream s;
  s << "| mixer | task | seq-len | pairs | d_model | state (elements) | accuracy | best lr | loss halved at | train time |\n";
  s << "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : results) {
    char acc[32], t[32];
    std::snprintf(acc, sizeof acc, "%.4f", r.accuracy);
    std::snprintf(t, sizeof t, "%.1fs", r.train_seconds);
    s << "| " << r.options.mixer << " | " << recall_task_name(r.options.task.task) << " | " << r.options.task.seq_len
      << " | " << r.options.task.pairs << " | " << r.options.d_model << " | " << r.state_elements << " | " << acc
      << " | " << fmt_g(double(r.best_lr)) << " | " << half_loss_cell(r) << " | " << t << " |\n";
  }
  return s.str();
}

RecallSeedsResult summarize_seeds(std::vector<RecallResult> runs) {
  RecallSeedsResult r;
  r.runs = std::move(runs);
  if (r.runs.empty()) return r;
  r.min = 1, r.max = 0;
  for (const auto& x : r.runs) {
    r.mean += x.accuracy / double(r.runs.size());
    r.min = std::min(r.min, x.accuracy);
    r.max = std::max(r.max, x.accuracy);
  }
  if (r.runs.size() > 1) {
    double ss = 0;
    for (const auto& x : r.runs) ss += (x.accuracy - r.mean) * (x.accuracy - r.mean);
    r.stddev = std::sqrt(ss / double(r.runs.size() - 1));
  }
  return r;
}

RecallSeedsResult run_recall_seeds(const RecallBenchOptions& o, const std::vector<int64_t>& seeds) {
  if (seeds.empty()) throw error("bench", "recall: no seeds given");
  std::vector<RecallResult> runs;
  for (const int64_t seed : seeds) {
    RecallBenchOptions os = o;
    os.seed = uint64_t(seed);
    runs.push_back(run_recall_bench(os));
  }
  return summarize_seeds(std::move(runs));
}

Json RecallSeedsResult::to_json() const {
  if (runs.empty()) return Json::object();
  Json j = runs[0].to_json();
  j["accuracy"] = mean;
  j["accuracy_min"] = min;
  j["accuracy_max"] = max;
  j["accuracy_stddev"] = stddev;
  j["seeds"] = Json::array();
  j["runs_by_seed"] = Json::array();
  for (const auto& r : runs) {
    j["seeds"].push_back(r.options.seed);
    j["runs_by_seed"].push_back(r.to_json());
  }
  j.erase("seed");
  j.erase("half_loss_step");  // per seed, in runs_by_seed
  return j;
}

std::string RecallSeedsResult::summary() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "mean accuracy over %zu seeds: %.4f (min %.4f, max %.4f, sd %.4f)\n", runs.size(),
                mean, min, max, stddev);
  return buf;
}

std::vector<RecallResult> run_recall_sweep(const RecallSweepOptions& o) {
  if (o.out_dir.empty()) throw error("recall", "--sweep needs --out DIR");
  std::filesystem::create_directories(o.out_dir);
  const std::vector<std::string> mixers = o.mixers.empty() ? recall_mixers() : o.mixers;
  std::vector<RecallResult> results;
  Json all = Json::array();
  for (int64_t T : o.seq_lens)
    for (const auto& mixer : mixers)
      for (int64_t d : o.d_models) {
        RecallBenchOptions b = o.base;
        b.mixer = mixer;
        b.d_model = d;
        b.task.seq_len = T;
        results.push_back(run_recall_bench(b));
        all.push_back(results.back().to_json());
        // Written after every run so an interrupted sweep keeps what it measured.
        write_text(o.out_dir + "/recall.json", all.dump(2) + "\n");
        write_text(o.out_dir + "/recall.md", "# Recall: " + recall_task_name(b.task.task) + "\n\n" +
                                                 recall_table_markdown(results));
      }
  // One series per (mixer, seq-len): accuracy against state size, as Zoology's figure.
  std::map<std::pair<int64_t, std::string>, PlotSeries> by;
  for (const auto& r : results) {
    auto& s = by[{r.options.task.seq_len, r.options.mixer}];
    s.name = r.options.mixer + (o.seq_lens.size() > 1 ? " T=" + std::to_string(r.options.task.seq_len) : "");
    s.markers = true;
    s.x.push_back(double(r.state_elements));
    s.y.push_back(r.accuracy);
  }
  std::vector<PlotSeries> series;
  for (auto& [k, s] : by) {
    std::vector<size_t> idx(s.x.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t c) { return s.x[a] < s.x[c]; });
    PlotSeries sorted = s;
    for (size_t i = 0; i < idx.size(); ++i) {
      sorted.x[i] = s.x[idx[i]];
      sorted.y[i] = s.y[idx[i]];
    }
    series.push_back(std::move(sorted));
  }
  PlotOptions po;
  po.title = "Recall (" + recall_task_name(o.base.task.task) + ") against state size";
  po.xlabel = "sequence memory at seq-len (elements)";
  po.ylabel = "held-out accuracy";
  po.log_x = true;
  write_svg_plot(o.out_dir + "/recall_vs_state.svg", series, po);
  return results;
}

}  // namespace k3
