// The training loop behind `k3 train`: data, tokenizer, model, AdamW + schedule, clipping,
// gradient accumulation, evaluation, checkpoints that resume bit-exactly, metrics, plot, sample.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/bpe.h"
#include "train/optimizer.h"

namespace k3 {

struct TrainConfig {
  std::string preset = "k3-tiny";
  std::vector<std::string> data;       // files or folders; empty: the built-in KJV corpus
  std::string tokenizer = "auto";      // auto (train a BPE of the preset's vocab size), gpt2, or a folder/tokenizer.json
  int64_t steps = 0;                   // total optimizer steps (0: the preset's default)
  int64_t decay_steps = 0;             // cosine horizon (0: the preset's default; independent of --steps so resumed runs match)
  int64_t batch = 0, seq_len = 0;      // 0: preset defaults
  int64_t grad_accum = 1;
  float lr = 0, min_lr_ratio = 0.1f, weight_decay = 0.1f, clip = 1.0f, beta2 = 0.95f;
  float z_loss = 0.0f;    // coefficient of the z-loss (0: off)
  float aux_loss = 0.0f;  // weight of the MoE sequence-level balance loss (0: off; the bias update always runs)
  int64_t warmup = -1;                 // -1: preset default
  uint64_t seed = 1;
  std::string out;                     // output folder (default runs/<preset>)
  std::string resume;                  // run folder (its latest checkpoint) or checkpoint folder to continue from
  bool overwrite = false;              // start over in an --out folder that holds an earlier run
  int64_t keep_checkpoints = 1;        // checkpoints kept in the run folder, newest first (0: all)
  int64_t eval_every = 100, eval_batches = 8, save_every = 0;
  int64_t sample_tokens = 120;
  bool quiet = false;                  // no progress bar (tests)
  std::string device = "cpu";          // cpu | cuda: where the parameters, activations, gradients and moments live
  std::string dtype = "f32";           // f32 | bf16: GEMM operands on CUDA (bf16: fp32 accumulation, fp32 master weights)
  bool gemm_tuning = true;             // CUDA: time cuBLASLt's candidates per GEMM shape, keep the fastest
  bool profile = false;                // time each step scope by scope (forward by layer, backward by op) and print the table
};

struct TrainResult {
  int64_t steps_done = 0;
  double last_loss = 0, val_loss = 0, unigram_loss = 0, tokens_per_second = 0;
  std::vector<double> losses;  // per step of this run
  std::string out_dir;
  bool interrupted = false;
  // A completed run's model and tokenizer, the first validation tokens as a prompt and the seed,
  // for the caller's sample text.
  std::shared_ptr<Model> model;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<int64_t> sample_prompt;
  uint64_t seed = 1;
};

TrainResult run_training(TrainConfig cfg);

// Validation loss of a saved model on a data path (same tokenizer as the model folder).
struct EvalResult {
  double val_loss = 0, perplexity = 0;
  int64_t tokens = 0;
};
EvalResult evaluate_model(const std::string& model_dir, const std::vector<std::string>& data, int64_t seq_len,
                          int64_t batches, uint64_t seed, Device device = Device::CPU);

// The built-in corpus: the King James Bible text extracted from Debian's bible-kjv package by
// the setup script (data/kjv.txt), or extracted now with `bible` if it is installed.
std::string default_corpus_path();

}  // namespace k3
