#include "train/trainer.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/device.h"
#include "core/profile.h"
#include "ops/ag.h"
#include "ops/gemm.h"
#include "ops/precision.h"
#include "models/presets.h"
#include "models/registry.h"
#include "tokenizer/bpe_train.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/plot.h"

namespace k3 {

namespace fs = std::filesystem;

namespace {

std::atomic<bool> g_interrupted{false};
// SIGINT and SIGTERM ask for a checkpoint and a clean stop. The handler stays installed until the
// final checkpoint is on disk, so a second Ctrl-C cannot cut the save short; it is acknowledged.
void on_stop_signal(int) {
  if (g_interrupted.exchange(true)) {
    static const char msg[] = "\nk3 train: stopping after the checkpoint being written (a kill now leaves the previous one intact)\n";
    ssize_t rc = ::write(2, msg, sizeof msg - 1);
    (void)rc;
  }
}

// Restores the previous SIGINT/SIGTERM handlers when the final checkpoint is on disk, or when
// training stops with an error.
class StopSignals {
 public:
  StopSignals() : int_(std::signal(SIGINT, on_stop_signal)), term_(std::signal(SIGTERM, on_stop_signal)) {}
  ~StopSignals() { restore(); }
  void restore() {
    if (done_) return;
    std::signal(SIGINT, int_);
    std::signal(SIGTERM, term_);
    done_ = true;
  }

 private:
  using Handler = void (*)(int);
  Handler int_, term_;
  bool done_ = false;
};

// A run folder that holds a checkpoint, or metrics, from an earlier run.
bool holds_a_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n == "latest" || n == "trainer_state.json" || n == "model.safetensors" || n.rfind("checkpoint-", 0) == 0) return true;
  }
  return false;
}

std::string shared_dir() {
  if (const char* e = std::getenv("K3_SHARED_DIR")) return e;
#ifdef K3_SHARED_DIR_DEFAULT
  return K3_SHARED_DIR_DEFAULT;
#else
  return "../shared";
#endif
}

std::string cache_dir() {
  if (const char* e = std::getenv("K3_CACHE_DIR")) return e;
  return ".k3cache";
}

void set_vocab(Json& config, int64_t vocab, std::optional<int32_t> eos) {
  Json& target = config.contains("text_config") ? config["text_config"] : config;
  target["vocab_size"] = vocab;
  if (eos) {
    target["eos_token_id"] = *eos;
    target["bos_token_id"] = *eos;
    if (config.contains("text_config")) config["eos_token_id"] = *eos;
  }
}

std::vector<std::string> read_corpus_texts(const std::vector<std::string>& files) {
  std::vector<std::string> texts;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    texts.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return texts;
}

Tokenizer make_tokenizer(const std::string& spec, const std::vector<std::string>& files, int64_t vocab, bool quiet) {
  if (spec == "gpt2") {
    std::string d = shared_dir() + "/data/gpt2";
    return Tokenizer::from_gpt2_files(d + "/encoder.json", d + "/vocab.bpe");
  }
  if (spec != "auto") {
    if (fs::is_directory(spec)) return Tokenizer::from_dir(spec);
    return Tokenizer::from_hf_tokenizer_json(spec);
  }
  // A byte-level BPE of the model's vocabulary size, trained on the corpus once and cached.
  std::ostringstream key;
  uint64_t h = 1469598103934665603ull;
  for (const auto& f : files) {
    std::error_code ec;
    std::string k = fs::absolute(f).string() + std::to_string(fs::file_size(f, ec));
    for (unsigned char c : k) h = (h ^ c) * 1099511628211ull;
  }
  key << cache_dir() << "/bpe-" << vocab << "-" << std::hex << h << ".json";
  if (fs::exists(key.str())) return Tokenizer::from_hf_tokenizer_json(key.str());
  if (!quiet) std::fprintf(stderr, "training a %lld-token byte-level BPE on the corpus...\n", (long long)vocab);
  BpeTrainOptions o;
  o.vocab_size = int32_t(vocab);
  Tokenizer tok = train_bpe(read_corpus_texts(files), o);
  fs::create_directories(cache_dir());
  tok.save_hf_tokenizer_json(key.str());
  return tok;
}

std::string fmt_duration(double s) {
  char b[32];
  if (s < 60) std::snprintf(b, sizeof b, "%.0fs", s);
  else if (s < 3600) std::snprintf(b, sizeof b, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(b, sizeof b, "%dh%02dm", int(s) / 3600, (int(s) / 60) % 60);
  return b;
}

void progress(int64_t step, int64_t total, double loss, double tps, double eta, bool tty) {
  const int width = 24;
  int filled = int(double(width) * double(step) / double(std::max<int64_t>(total, 1)));
  std::string bar(size_t(filled), '=');
  if (filled < width) bar += '>';
  bar.resize(size_t(width), ' ');
  std::fprintf(stderr, "%sstep %lld/%lld [%s] loss %.4f | %.0f tok/s | ETA %s%s", tty ? "\r" : "", (long long)step,
               (long long)total, bar.c_str(), loss, tps, fmt_duration(eta).c_str(), tty ? "   " : "\n");
  std::fflush(stderr);
}

double eval_loss(const Model& model, const TokenData& data, int64_t B, int64_t T, int64_t batches) {
  std::vector<int64_t> ids, targets;
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    data.batch(Split::Val, B, T, /*seed*/ 12345, i, ids, targets);
    Var l = model.loss(TokenBatch{ids.data(), B, T, nullptr}, targets);
    sum += l->value.f32()[0];
  }
  return sum / double(batches);
}

}  // namespace

std::string default_corpus_path() {
  std::vector<std::string> candidates;
  if (const char* e = std::getenv("K3_CORPUS")) candidates.push_back(e);
  candidates.push_back("data/kjv.txt");
  candidates.push_back(cache_dir() + "/kjv.txt");
  for (const auto& c : candidates)
    if (fs::exists(c) && fs::file_size(c) > 1000) return c;
  // Extract it now with Debian's bible-kjv `bible` tool.
  if (std::system("command -v bible >/dev/null 2>&1") == 0) {
    fs::create_directories(cache_dir());
    std::string path = cache_dir() + "/kjv.txt";
    std::string cmd = "bible -f gen1:1-rev22:21 > '" + path + ".tmp' 2>/dev/null && mv '" + path + ".tmp' '" + path + "'";
    if (std::system(cmd.c_str()) == 0 && fs::exists(path) && fs::file_size(path) > 1000) return path;
  }
  throw error("train", "no built-in corpus: install Debian's bible-kjv package (scripts/setup.sh does) or pass --data PATH");
}

TrainResult run_training(TrainConfig cfg) {
  using clock = std::chrono::steady_clock;
  int64_t start_step = 0;
  Json resume_state;
  OpenedCheckpoint ckpt;
  if (!cfg.resume.empty()) {
    ckpt = open_checkpoint(cfg.resume);  // verified: model, optimizer, tokenizer and state of one step
    resume_state = ckpt.state;
    const std::string sp = ckpt.dir + "/trainer_state.json";
    try {
      start_step = ckpt.step;
      const std::string saved = resume_state.at("preset").get<std::string>();
      if (!cfg.preset.empty() && cfg.preset != saved && cfg.preset != TrainConfig{}.preset)
        throw error("train", "--preset ", cfg.preset, " differs from the checkpoint's preset ", saved);
      cfg.preset = saved;
      cfg.data = resume_state.at("data").get<std::vector<std::string>>();
      cfg.batch = resume_state.at("batch").get<int64_t>();
      cfg.seq_len = resume_state.at("seq_len").get<int64_t>();
      cfg.lr = resume_state.at("lr").get<float>();
      cfg.warmup = resume_state.at("warmup").get<int64_t>();
      cfg.decay_steps = resume_state.at("decay_steps").get<int64_t>();
      cfg.grad_accum = resume_state.at("grad_accum").get<int64_t>();
      cfg.seed = resume_state.at("seed").get<uint64_t>();
      cfg.weight_decay = resume_state.at("weight_decay").get<float>();
      cfg.clip = resume_state.at("clip").get<float>();
      cfg.beta2 = resume_state.at("beta2").get<float>();
      cfg.min_lr_ratio = resume_state.at("min_lr_ratio").get<float>();
      cfg.z_loss = resume_state.value("z_loss", 0.0f);
      cfg.aux_loss = resume_state.value("aux_loss", 0.0f);
    } catch (const Json::exception& e) {
      throw error("train", sp, ": incomplete trainer state (", e.what(), ")");
    }
    if (cfg.out.empty()) cfg.out = ckpt.run_dir;
  }
  const Preset& preset = find_preset(cfg.preset);
  if (!preset.train) throw error("train", "preset '", cfg.preset, "' is not a trainable preset (try k3-tiny, gpt2-tiny, ...)");
  const TrainDefaults& d = *preset.train;
  if (cfg.steps <= 0) cfg.steps = d.steps;
  if (cfg.decay_steps <= 0) cfg.decay_steps = d.steps;
  if (cfg.batch <= 0) cfg.batch = d.batch;
  if (cfg.seq_len <= 0) cfg.seq_len = d.seq_len;
  if (cfg.lr <= 0) cfg.lr = d.lr;
  if (cfg.warmup < 0) cfg.warmup = d.warmup;
  if (cfg.grad_accum < 1) throw error("train", "--grad-accum must be >= 1");
  if (cfg.device != "cpu" && cfg.device != "cuda") throw error("train", "--device ", cfg.device, ": cpu or cuda");
  if (cfg.dtype != "f32" && cfg.dtype != "bf16") throw error("train", "--dtype ", cfg.dtype, ": f32 or bf16");
  if (cfg.dtype == "bf16" && cfg.device != "cuda")
    throw error("train", "--dtype bf16 (bf16 GEMM operands) applies to --device cuda; the CPU trains in fp32");
  if (cfg.out.empty()) {
    // The default folder is never an earlier run's: runs/PRESET, else runs/PRESET-2, -3, ...
    cfg.out = "runs/" + cfg.preset;
    for (int i = 2; cfg.resume.empty() && holds_a_run(cfg.out); ++i) cfg.out = "runs/" + cfg.preset + "-" + std::to_string(i);
  } else if (cfg.resume.empty() && holds_a_run(cfg.out) && !cfg.overwrite) {
    throw error("train", "--out ", cfg.out, " holds an earlier run's checkpoint; continue it with --resume ", cfg.out,
                ", or pass --overwrite to start over there");
  }
  if (cfg.keep_checkpoints < 0) throw error("train", "--keep-checkpoints must be >= 0 (0 keeps all)");
  if (cfg.data.empty()) cfg.data = {default_corpus_path()};
  if (start_step >= cfg.steps)
    throw error("train", "the checkpoint is already at step ", start_step, "; ask for more with --steps N (N > ", start_step, ")");
  fs::create_directories(cfg.out);
  const RunDirLock lock(cfg.out);
  remove_stale_temporaries(cfg.out);  // what killed saves left
  if (cfg.resume.empty() && cfg.overwrite) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cfg.out)) {
      const std::string n = e.path().filename().string();
      if (n == ".lock") continue;
      fs::remove_all(e.path(), ec);
    }
  }

  // Tokenizer and data.
  Json config = preset.config();
  const int64_t preset_vocab = config.contains("text_config") ? config["text_config"]["vocab_size"].get<int64_t>()
                                                               : config["vocab_size"].get<int64_t>();
  std::vector<std::string> files = list_text_files(cfg.data);
  Tokenizer tok = !cfg.resume.empty() ? Tokenizer::from_hf_tokenizer_json(ckpt.dir + "/tokenizer.json")
                                      : make_tokenizer(cfg.tokenizer, files, preset_vocab, cfg.quiet);
  TokenData data = TokenData::build(files, tok, cache_dir());
  set_vocab(config, tok.vocab_size(), tok.eos_id());

  // Model and optimizer.
  std::unique_ptr<Model> model;
  if (!cfg.resume.empty()) {
    model = load_model(ckpt.dir);
  } else {
    model = build_model(config, cfg.preset);
    model->init_random(cfg.seed);
  }
  // fp32 parameters where the run asks; gradients and AdamW moments follow them.
  move_to(*model, cfg.device == "cuda" ? Device::CUDA : Device::CPU);
  set_device_gemm_tuning(cfg.gemm_tuning);
  if (cfg.seq_len > model->max_positions())
    throw error("train", "--seq-len ", cfg.seq_len, " exceeds the model's ", model->max_positions(), " positions");
  AdamWOptions ao;
  ao.lr = cfg.lr;
  ao.weight_decay = cfg.weight_decay;
  ao.beta2 = cfg.beta2;
  AdamW opt(ao);
  if (!cfg.resume.empty()) opt.load(ckpt.dir + "/optimizer.safetensors", *model);
  LrSchedule sched{cfg.lr, cfg.min_lr_ratio, cfg.warmup, cfg.decay_steps};

  // Metrics: keep the lines of the steps already done (resume), drop any later ones.
  const std::string metrics_path = cfg.out + "/metrics.jsonl";
  std::vector<std::string> kept;
  std::vector<double> plot_x, plot_y, val_x, val_y;
  if (!cfg.resume.empty() && fs::exists(ckpt.run_dir + "/metrics.jsonl")) {
    std::ifstream in(ckpt.run_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      try {
        Json j = Json::parse(line);
        if (j.value("step", int64_t(0)) > start_step) continue;
        plot_x.push_back(j["step"].get<double>());
        plot_y.push_back(j["loss"].get<double>());
        if (j.contains("val_loss")) val_x.push_back(j["step"].get<double>()), val_y.push_back(j["val_loss"].get<double>());
        kept.push_back(line);
      } catch (const Json::exception&) {
      }
    }
  }
  {
    std::ofstream out(metrics_path, std::ios::trunc);
    for (const auto& l : kept) out << l << "\n";
  }
  std::ofstream metrics(metrics_path, std::ios::app);

  const bool tty = ::isatty(2) && !cfg.quiet;
  const double unigram = data.unigram_baseline(tok.vocab_size());
  if (!cfg.quiet) {
    std::fprintf(stderr, "k3 train: %s, %s parameters, vocab %d, %lld train / %lld val tokens%s\n", cfg.preset.c_str(),
                 std::to_string(model->total_params()).c_str(), tok.vocab_size(), (long long)data.size(Split::Train),
                 (long long)data.size(Split::Val), data.from_cache() ? " (cached)" : "");
    std::fprintf(stderr, "batch %lld x %lld tokens x %lld accumulation, lr %.2e (warmup %lld, cosine over %lld), steps %lld..%lld on %s -> %s\n",
                 (long long)cfg.batch, (long long)cfg.seq_len, (long long)cfg.grad_accum, cfg.lr, (long long)cfg.warmup,
                 (long long)cfg.decay_steps, (long long)start_step, (long long)cfg.steps,
                 cfg.device == "cuda" ? ("CUDA (" + std::string(device::describe()) +
                                         (cfg.dtype == "bf16" ? ", bf16 GEMMs, fp32 weights)" : ", fp32)")).c_str()
                                      : "the CPU",
                 cfg.out.c_str());
  }

  int64_t saved_step = cfg.resume.empty() ? -1 : start_step;
  auto save_checkpoint = [&](int64_t step) {
    if (step == saved_step) return;
    const std::string tmp = begin_checkpoint(cfg.out, step);
    save_model(*model, tmp);
    tok.save_hf_tokenizer_json(tmp + "/tokenizer.json");
    opt.save(tmp + "/optimizer.safetensors");
    Json st = {{"preset", cfg.preset},   {"data", cfg.data},
               {"batch", cfg.batch},   {"seq_len", cfg.seq_len}, {"lr", cfg.lr},
               {"warmup", cfg.warmup}, {"decay_steps", cfg.decay_steps}, {"grad_accum", cfg.grad_accum},
               {"seed", cfg.seed},     {"weight_decay", cfg.weight_decay}, {"clip", cfg.clip},
               {"beta2", cfg.beta2},   {"min_lr_ratio", cfg.min_lr_ratio}, {"z_loss", cfg.z_loss},
               {"aux_loss", cfg.aux_loss}, {"device", cfg.device},     {"dtype", cfg.dtype}};
    publish_checkpoint(cfg.out, tmp, step, st, CheckpointWriteOptions{int(cfg.keep_checkpoints)});
    saved_step = step;
  };

  g_interrupted = false;
  StopSignals stop_signals;
  TrainResult res;
  res.out_dir = cfg.out;
  res.seed = cfg.seed;
  res.unigram_loss = unigram;
  std::vector<int64_t> ids, targets;
  const auto t_start = clock::now();
  int64_t step = start_step;
  double tokens_done = 0;
  double profiled_seconds = 0;
  if (cfg.profile) profile::reset();
  for (; step < cfg.steps; ++step) {
    if (g_interrupted) {
      res.interrupted = true;
      break;
    }
    auto t0 = clock::now();
    double loss = 0;
    if (cfg.profile) profile::enable(cfg.device == "cuda");
    double gnorm = 0;
    float lr = 0;
    {
      const profile::Scope step_scope("step");
      zero_grad(*model);
      for (int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
        data.batch(Split::Train, cfg.batch, cfg.seq_len, cfg.seed, step * cfg.grad_accum + micro, ids, targets);
        Recording rec;
        std::optional<ag::gpu::Bf16Gemms> bf16;  // bf16 GEMM operands for this micro-batch (CUDA)
        if (cfg.dtype == "bf16") bf16.emplace();
        Var l;
        {
          const profile::Scope phase("forward");
          l = model->loss(TokenBatch{ids.data(), cfg.batch, cfg.seq_len, nullptr}, targets, cfg.z_loss);
          loss += l->value.f32()[0] / double(cfg.grad_accum);
          if (cfg.aux_loss > 0)
            if (Var aux = model->aux_loss(cfg.seq_len, cfg.aux_loss)) l = ag::add(l, aux);
        }
        const profile::Scope phase("backward");
        Tensor seed = Tensor::full({1}, 1.0f / float(cfg.grad_accum));
        backward(l, seed);
      }
      if (!std::isfinite(loss)) {
        if (cfg.profile) profile::disable();
        std::fprintf(stderr, "\n");
        throw error("train", "loss became ", loss, " at step ", step, " (try a lower --lr); last checkpoint is in ", cfg.out);
      }
      {
        const profile::Scope phase("gradient clipping");
        gnorm = clip_grad_norm(*model, cfg.clip);
      }
      {
        const profile::Scope phase("optimizer");
        lr = sched.at(step);
        opt.step(*model, lr);
      }
      const profile::Scope phase("after step (router bias)");
      model->after_step();
    }
    if (cfg.profile) profile::disable();
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (cfg.profile) profiled_seconds += dt;
    tokens_done += double(cfg.batch * cfg.seq_len * cfg.grad_accum);
    const double elapsed = std::chrono::duration<double>(clock::now() - t_start).count();
    const double tps = tokens_done / elapsed;
    res.losses.push_back(loss);
    res.last_loss = loss;
    Json m = {{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
              {"tokens_per_s", double(cfg.batch * cfg.seq_len * cfg.grad_accum) / dt}, {"elapsed_s", elapsed}};
    if (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) {
      double vl = eval_loss(*model, data, cfg.batch, cfg.seq_len, cfg.eval_batches);
      m["val_loss"] = vl;
      val_x.push_back(double(step + 1));
      val_y.push_back(vl);
      if (!cfg.quiet) std::fprintf(stderr, "%sstep %lld: val_loss %.4f\n", tty ? "\n" : "", (long long)(step + 1), vl);
    }
    metrics << m.dump() << "\n";
    metrics.flush();
    plot_x.push_back(double(step + 1));
    plot_y.push_back(loss);
    if (!cfg.quiet && (tty || (step + 1) % 25 == 0 || step + 1 == cfg.steps))
      progress(step + 1, cfg.steps, loss, tps, double(cfg.steps - step - 1) * elapsed / double(step + 1 - start_step), tty);
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) save_checkpoint(step + 1);
  }
  if (tty) std::fprintf(stderr, "\n");
  res.steps_done = step;
  if (cfg.profile && step > start_step) {
    const double n = double(step - start_step);
    std::printf("where a training step goes (%lld steps, %.2f ms/step, %s; the backward by op, in reverse order of the forward):\n",
                (long long)(step - start_step), 1e3 * profiled_seconds / n,
                cfg.device == "cuda" ? "the device drained at every scope boundary" : "host wall clock");
    std::printf("%s\n", profile::format_table(n, profiled_seconds).c_str());
  }
  res.tokens_per_second = tokens_done / std::max(1e-9, std::chrono::duration<double>(clock::now() - t_start).count());
  save_checkpoint(step);
  stop_signals.restore();  // the final checkpoint is on disk
  if (res.interrupted) {
    std::fprintf(stderr, "interrupted at step %lld: checkpoint saved in %s (continue with: k3 train --resume %s --steps %lld)\n",
                 (long long)step, cfg.out.c_str(), cfg.out.c_str(), (long long)cfg.steps);
    return res;
  }
  res.val_loss = eval_loss(*model, data, cfg.batch, cfg.seq_len, cfg.eval_batches);
  {
    const int32_t* val = data.tokens(Split::Val);
    res.sample_prompt.assign(val, val + std::min<int64_t>(16, data.size(Split::Val)));
  }
  // Loss curve.
  std::vector<PlotSeries> series = {{"train loss", plot_x, plot_y, "", false}};
  if (!val_x.empty()) series.push_back({"validation loss", val_x, val_y, "", true});
  series.push_back({"unigram baseline", {plot_x.empty() ? 0.0 : plot_x.front(), plot_x.empty() ? 1.0 : plot_x.back()},
                    {unigram, unigram}, "#999999", false});
  write_svg_plot(cfg.out + "/loss.svg", series,
                 PlotOptions{"k3 train " + cfg.preset, "step", "cross-entropy (nats/token)", false, false, 760, 440});
  if (!cfg.quiet) {
    std::printf("final: train loss %.4f | validation loss %.4f (perplexity %.1f) | unigram baseline %.4f | %.0f tokens/s\n",
                res.last_loss, res.val_loss, std::exp(res.val_loss), unigram, res.tokens_per_second);
    std::printf("wrote %s/{model.safetensors,config.json,tokenizer.json,optimizer.safetensors,metrics.jsonl,loss.svg}\n",
                cfg.out.c_str());
  }
  res.model = std::move(model);
  res.tokenizer = std::make_shared<const Tokenizer>(std::move(tok));
  return res;
}

EvalResult evaluate_model(const std::string& model_dir, const std::vector<std::string>& data_paths, int64_t seq_len,
                          int64_t batches, uint64_t seed, Device device) {
  auto model = load_model(model_dir);
  move_to(*model, device);  // the loss's logits are made there too
  Tokenizer tok = Tokenizer::from_dir(model_dir);
  std::vector<std::string> paths = data_paths;
  Json st;
  if (fs::exists(model_dir + "/trainer_state.json")) st = read_json_file(model_dir + "/trainer_state.json");
  if (paths.empty()) paths = st.contains("data") ? st["data"].get<std::vector<std::string>>() : std::vector<std::string>{default_corpus_path()};
  if (seq_len <= 0) seq_len = st.value("seq_len", std::min<int64_t>(128, model->max_positions()));
  const int64_t B = st.value("batch", int64_t(8));
  TokenData data = TokenData::build(list_text_files(paths), tok, cache_dir());
  (void)seed;
  EvalResult r;
  r.val_loss = eval_loss(*model, data, B, seq_len, batches);
  r.perplexity = std::exp(r.val_loss);
  r.tokens = B * seq_len * batches;
  return r;
}

}  // namespace k3
