// k3 train / k3 eval.
#include <cmath>
#include <cstdio>
#include <fstream>

#include "cli/commands.h"
#include "infer/generate.h"
#include "train/data.h"
#include "train/trainer.h"

namespace k3::cli {

void register_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from scratch (default: k3-tiny on the King James Bible, CPU; --device cuda trains on the GPU in fp32)");
  static TrainConfig c;
  static RuntimeOptions rt;
  cmd->add_option("--preset", c.preset, "Model preset (k3-tiny, kimi-linear-tiny, kda-tiny, gdn-tiny, deltanet-tiny, linear-tiny, gpt2-tiny, and -small versions)")->capture_default_str();
  cmd->add_option("--data", c.data, "Text files or folders of *.txt (default: the KJV corpus)");
  cmd->add_option("--tokenizer", c.tokenizer, "auto (train a BPE of the preset's vocab size on the data), gpt2, or a tokenizer folder/file")->capture_default_str();
  cmd->add_option("--steps", c.steps, "Total optimizer steps (with --resume: continue up to this many)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--decay-steps", c.decay_steps, "Cosine schedule length (default: the preset's; independent of --steps so resumed runs match)");
  cmd->add_option("--batch", c.batch, "Sequences per micro-batch");
  cmd->add_option("--seq-len", c.seq_len, "Tokens per sequence");
  cmd->add_option("--grad-accum", c.grad_accum, "Micro-batches per optimizer step")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--lr", c.lr, "Peak learning rate (default: the preset's)");
  cmd->add_option("--warmup", c.warmup, "Warmup steps (default: the preset's)");
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW decoupled weight decay (matrices only)")->capture_default_str();
  cmd->add_option("--clip", c.clip, "Gradient clipping by global norm (0 = off)")->capture_default_str();
  cmd->add_option("--seed", c.seed, "Seed for init and batches")->capture_default_str();
  cmd->add_option("--z-loss", c.z_loss, "z-loss coefficient (e.g. 1e-4; 0 = off)")->capture_default_str();
  cmd->add_option("--aux-loss", c.aux_loss, "MoE sequence-level balance loss weight (e.g. 1e-3; 0 = off)")->capture_default_str();
  cmd->add_option("--out", c.out, "Run folder (default: runs/PRESET, or runs/PRESET-2, ... if that holds a run; with --resume, the run resumed)");
  cmd->add_option("--resume", c.resume, "Continue a run: its folder (the latest checkpoint) or one checkpoint-STEP folder in it");
  cmd->add_flag("--overwrite", c.overwrite, "Start over in an --out folder that holds an earlier run (its checkpoints are deleted)");
  cmd->add_option("--keep-checkpoints", c.keep_checkpoints, "Checkpoints kept in the run folder, newest first (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--eval-every", c.eval_every, "Report validation loss every N steps (0 = only at the end)")->capture_default_str();
  cmd->add_option("--eval-batches", c.eval_batches, "Batches per validation estimate")->capture_default_str();
  cmd->add_option("--save-every", c.save_every, "Write a checkpoint every N steps (always at the end and on Ctrl-C)")->capture_default_str();
  cmd->add_option("--sample-tokens", c.sample_tokens, "Tokens of sample text printed at the end")->capture_default_str();
  cmd->add_option("--dtype", c.dtype, "GEMM operands with --device cuda: f32, or bf16 (fp32 accumulation, gradients and master weights)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--gemm-tuning", c.gemm_tuning,
                  "With --device cuda: time cuBLASLt's candidate algorithms on each GEMM shape's first call and keep "
                  "the fastest (false: its heuristic's first guess, the same algorithm run to run)")
      ->capture_default_str();
  cmd->add_flag("--quiet", c.quiet, "No progress bar, summary or sample");
  cmd->add_flag("--profile", c.profile,
                "Time each step scope by scope (the forward by layer and mixer, the backward by op, the optimizer) and "
                "print where a step goes at the end");
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    c.device = rt.device;
    TrainResult r = run_training(c);
    if (!r.interrupted && !c.quiet && c.sample_tokens > 0 && r.model && r.tokenizer && !r.sample_prompt.empty()) {
      GenerateOptions g;
      g.max_new_tokens = std::min<int64_t>(c.sample_tokens, r.model->max_positions() - int64_t(r.sample_prompt.size()));
      g.sampling.temperature = 0.8f;
      g.sampling.top_k = 40;
      g.sampling.seed = r.seed;
      g.stop_at_eos = StopAtEos::No;
      const std::vector<int64_t> ids = generate(*r.model, r.sample_prompt, g);
      std::printf("sample:\n%s\n", r.tokenizer->decode(std::vector<int32_t>(ids.begin(), ids.end())).c_str());
    }
    if (!r.interrupted && !c.quiet && r.val_loss >= r.unigram_loss)
      std::printf("note: validation loss is not below the unigram baseline yet; train longer (--steps)\n");
  });
}

void register_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Validation loss and perplexity of a saved model");
  static std::string model;
  static std::vector<std::string> data;
  static int64_t seq_len = 0, batches = 16;
  static RuntimeOptions rt;
  cmd->add_option("--model", model, "Model folder (e.g. the output of k3 train)")->required();
  cmd->add_option("--data", data, "Text files or folders (default: the data the model was trained on)");
  cmd->add_option("--seq-len", seq_len, "Tokens per sequence (default: the training length)");
  cmd->add_option("--batches", batches, "Validation batches")->capture_default_str()->check(CLI::PositiveNumber);
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    EvalResult r = evaluate_model(model, data, seq_len, batches, 12345, rt.device == "cuda" ? Device::CUDA : Device::CPU);
    std::printf("val_loss=%.6f\nperplexity=%.4f\ntokens=%lld\n", r.val_loss, r.perplexity, (long long)r.tokens);
  });
}

}  // namespace k3::cli
