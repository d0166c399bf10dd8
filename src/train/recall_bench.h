// `k3 bench recall`: trains a 2-layer model of one mixer family on a synthetic recall task
// (recall_tasks.h) from scratch and measures its accuracy on held-out examples; the sweep runs
// the grid mixer × seq-len × d_model and writes the recall-vs-state-size table and plot.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "io/config.h"
#include "train/recall_tasks.h"

namespace k3 {

// softmax | linear | deltanet | gdn | kda | k3-hybrid
const std::vector<std::string>& recall_mixers();

// The 2-layer model config of a mixer at width d for a vocabulary and sequence length.
Json recall_model_config(const std::string& mixer, int64_t vocab, int64_t seq_len, int64_t d_model);

struct RecallBenchOptions {
  RecallTaskOptions task;
  std::string mixer = "softmax";
  int64_t d_model = 64;
  int64_t steps = 0;          // 0 = default_steps
  int64_t batch = 32;
  std::vector<float> lrs;     // empty = the mixer's default_recall_lr; more than one: best of the grid
  float weight_decay = 0.1f;
  float warmup_frac = 0.1f;   // linear warmup over this fraction of the steps, then cosine to 10 %
  int64_t test_examples = 256;
  uint64_t seed = 1;
  bool quiet = false;         // progress on stderr unless quiet
  int64_t log_every = 50;
  bool cuda = false;          // train on the GPU (fp32); the held-out evaluation runs on the host
};

struct RecallRun {
  float lr = 0;
  double accuracy = 0, final_train_loss = 0, train_seconds = 0;
  int64_t half_loss_step = -1;     // half_loss_step(loss_curve)
  std::vector<double> loss_curve;  // the training loss of every step
};

// When a run leaves the loss plateau: the number of steps after which the training loss, smoothed
// as the progress line smooths it (avg ← 0.9 avg + 0.1 loss, starting at the first step's loss),
// is first below half the first step's loss; −1 if it never is. The recall tasks start at about
// ln(vocab) and sit on a plateau well above half of it until the model learns to retrieve.
int64_t half_loss_step(const std::vector<double>& loss_curve);

struct RecallResult {
  RecallBenchOptions options;  // with the task's defaults filled in
  int64_t state_elements = 0;  // recurrent state, or KV elements at seq_len for attention layers
  int64_t params = 0;
  double accuracy = 0;         // best over the lr grid
  float best_lr = 0;
  double train_seconds = 0;    // all lrs together
  std::vector<RecallRun> runs;
  const RecallRun* best_run() const;  // the first run at best_lr (null before any run)
  Json to_json() const;
};

// Default training steps for a task (the CPU setting; see recall_tasks.md).
int64_t default_recall_steps(RecallTask t);
// Default peak learning rate of a mixer (from the lr sweep in recall_tasks.md).
float default_recall_lr(const std::string& mixer);

// Elements of sequence memory the model keeps at seq_len tokens: layers × heads × dk × dv of
// the recurrent states plus, for attention layers, the K/V (or MLA latent) entries of seq_len
// tokens. Short-convolution tails are not counted.
int64_t recall_state_elements(const Json& config, int64_t seq_len);

RecallResult run_recall_bench(RecallBenchOptions o);

struct RecallSweepOptions {
  RecallBenchOptions base;
  std::vector<std::string> mixers;
  std::vector<int64_t> seq_lens, d_models;
  std::string out_dir;
};
// Runs the grid (pairs follow each seq-len's task default unless base.task.pairs is set) and
// writes out_dir/recall.md, recall.json and recall_vs_state.svg. Returns the results.
std::vector<RecallResult> run_recall_sweep(const RecallSweepOptions& o);

// The result table (markdown) of any number of results.
std::string recall_table_markdown(const std::vector<RecallResult>& results);

// One configuration over several seeds: every run, and the accuracy's mean and spread.
struct RecallSeedsResult {
  std::vector<RecallResult> runs;  // one per seed, in the order given
  double mean = 0, min = 0, max = 0, stddev = 0;  // of the runs' accuracies (stddev: sample, n − 1)
  // The first run's record with the mean as "accuracy", the spread beside it and every run under
  // "runs_by_seed".
  Json to_json() const;
  std::string summary() const;  // "mean accuracy over N seeds: ..."
};
RecallSeedsResult run_recall_seeds(const RecallBenchOptions& o, const std::vector<int64_t>& seeds);
// The mean and spread of results already run.
RecallSeedsResult summarize_seeds(std::vector<RecallResult> runs);

}  // namespace k3
