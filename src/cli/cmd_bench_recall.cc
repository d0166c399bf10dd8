// k3 bench recall: the synthetic recall suite (MQAR, Palindrome, Stack) over the mixer family.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "train/recall_bench.h"

namespace k3::cli {

namespace {

template <class T>
std::vector<T> split_list(const std::string& s, const char* what) {
  std::vector<T> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      if constexpr (std::is_same_v<T, std::string>) v.push_back(item);
      else if constexpr (std::is_same_v<T, float>) v.push_back(std::stof(item));
      else v.push_back(T(std::stoll(item)));
    } catch (const std::exception&) {
      throw error("bench", "'", item, "' is not a valid entry of ", what, " '", s, "'");
    }
  }
  if (v.empty()) throw error("bench", what, " is empty");
  return v;
}

const char* kRecallHelp =
    "Train a 2-layer model of one mixer family from scratch on a synthetic recall task and measure its\n"
    "greedy accuracy on held-out examples (a different seed stream than training), and the step at\n"
    "which its smoothed training loss first fell below half its initial value (leaving the plateau).\n"
    "Tasks (details in src/train/recall_tasks.md):\n"
    "  mqar        Zoology MQAR: --pairs key-value pairs (default seq-len/8), then one query per key at\n"
    "              power-law placed slots (power_a 0.01), filler token 0 elsewhere; keys [1,V/2), values\n"
    "              [V/2,V); scored at each query key (predict its value).\n"
    "  palindrome  random tokens, <sep>, the reverse; --pairs = tokens to reverse (default (seq-len-1)/2);\n"
    "              scored on the reversed half.\n"
    "  stack       Kimi Linear stack: --pairs stacks (default 64); ops '<push> id X' and '<pop> id X' of 3\n"
    "              tokens each, seq-len/3 ops; scored at a pop's id (predict the top element X).\n"
    "  overwrite   units 'k v': writes bind --pairs keys (default 8) again and again; about half the units\n"
    "              query a written key, scored at the key (predict its latest value, not a stale one).\n"
    "  capacity    as overwrite, but every write takes a fresh key, far more than a small state holds, and\n"
    "              a query asks one of the --pairs most recent writes (default seq-len/8).\n"
    "  niah        needles in a haystack: --pairs needles '<needle> k v' (default 1) at random places in\n"
    "              random filler, then '<query> k' for one of them, scored at k (predict its v).\n"
    "Vocab 256 by default (--vocab). Batch 32, 1500 steps, AdamW lr 1e-2 for softmax and 3e-3 for the\n"
    "others (wd 0.1, 10% warmup, cosine to 10%), 256 held-out test examples. Models: softmax = GPT-2\n"
    "(learned positions) with the short conv 4 over q|k|v that the others have; linear / deltanet / gdn /\n"
    "kda = fla-style (2 heads, head_dim d/2, short conv 4, SwiGLU MLP; gdn without output gate and with\n"
    "slow initial forgetting, see recall_tasks.md); k3-hybrid = Kimi K3 in\n"
    "miniature, layer 1 KDA + layer 2 gated MLA, dense. State = layers x heads x dk x dv, or K/V (MLA\n"
    "latent) elements at seq-len for attention layers.";

}  // namespace

void register_bench_recall(CLI::App* bench) {
  auto* cmd = bench->add_subcommand("recall", "Synthetic recall suite (MQAR, Palindrome, Stack) over the mixer family");
  cmd->footer(kRecallHelp);
  static RecallBenchOptions o;
  static std::string task = "mqar", lrs, json_out, mixers, seq_lens = "64,128,256", d_models = "32,64,128", out_dir,
                     seeds;
  static float lr = 0;
  static bool sweep = false;
  static RuntimeOptions rt;
  cmd->add_option("--task", task, "mqar | palindrome | stack | overwrite | capacity | niah")
      ->capture_default_str()
      ->check(CLI::IsMember({"mqar", "palindrome", "stack", "overwrite", "capacity", "niah"}));
  cmd->add_option("--mixer", o.mixer, "softmax | linear | deltanet | gdn | kda | k3-hybrid")
      ->capture_default_str()
      ->check(CLI::IsMember(recall_mixers()));
  cmd->add_option("--seq-len", o.task.seq_len, "Tokens per example")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--pairs", o.task.pairs, "MQAR key-value pairs / Palindrome tokens reversed / Stack stacks / Overwrite keys / Capacity query window / Niah needles (0 = task default)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--vocab", o.task.vocab, "Vocabulary size (0 = task default, 256)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--power-a", o.task.power_a, "MQAR query placement exponent (Zoology power_a)")->capture_default_str();
  cmd->add_option("--d-model", o.d_model, "Model width")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--steps", o.steps, "Training steps (0 = task default, 1500)")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--batch", o.batch, "Training examples per step")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--lr", lr, "Peak learning rate (0 = the mixer's default: softmax 1e-2, others 3e-3)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--lr-grid", lrs, "Comma-separated learning rates: train once per lr, report the best (overrides --lr)");
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--test-examples", o.test_examples, "Held-out examples evaluated")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--seed", o.seed, "Seed of init and data streams")->capture_default_str();
  cmd->add_option("--seeds", seeds,
                  "Comma-separated seeds: one run each, the mean accuracy reported (single runs of the default setting "
                  "differ by about 0.5% from seed to seed; see recall_tasks.md)");
  cmd->add_option("--json", json_out, "Write the result as JSON here");
  cmd->add_flag("--sweep", sweep, "Run the grid --mixers x --seq-lens x --d-models and write --out DIR");
  cmd->add_option("--mixers", mixers, "Sweep: comma-separated mixers (default: all six)");
  cmd->add_option("--seq-lens", seq_lens, "Sweep: comma-separated sequence lengths")->capture_default_str();
  cmd->add_option("--d-models", d_models, "Sweep: comma-separated widths")->capture_default_str();
  cmd->add_option("--out", out_dir, "Sweep: output folder (recall.md, recall.json, recall_vs_state.svg)");
  cmd->add_flag("--quiet", o.quiet, "No progress on stderr");
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    o.cuda = rt.device == "cuda";
    o.task.task = parse_recall_task(task);
    o.lrs = !lrs.empty() ? split_list<float>(lrs, "--lr-grid") : lr > 0 ? std::vector<float>{lr} : std::vector<float>{};
    if (sweep && !seeds.empty()) throw error("bench", "--seeds does not combine with --sweep (one seed per grid: --seed)");
    Json j;
    if (sweep) {
      RecallSweepOptions so;
      so.base = o;
      if (!mixers.empty()) so.mixers = split_list<std::string>(mixers, "--mixers");
      so.seq_lens = split_list<int64_t>(seq_lens, "--seq-lens");
      so.d_models = split_list<int64_t>(d_models, "--d-models");
      so.out_dir = out_dir;
      const std::vector<RecallResult> results = run_recall_sweep(so);
      std::printf("%s\nwrote %s/recall.md, recall.json, recall_vs_state.svg\n", recall_table_markdown(results).c_str(),
                  out_dir.c_str());
      j = Json::array();
      for (const auto& r : results) j.push_back(r.to_json());
    } else if (!seeds.empty()) {  // --seeds: the mean as "accuracy", every run beside it
      const RecallSeedsResult rs = run_recall_seeds(o, split_list<int64_t>(seeds, "--seeds"));
      std::printf("%s%s", recall_table_markdown(rs.runs).c_str(), rs.summary().c_str());
      j = rs.to_json();
    } else {
      const RecallResult r = run_recall_bench(o);
      std::printf("%s", recall_table_markdown({r}).c_str());
      j = r.to_json();
    }
    if (!json_out.empty()) {
      std::ofstream f(json_out);
      f << j.dump(2) << "\n";
      if (!f) throw error("bench", "cannot write ", json_out);
    }
  });
}

}  // namespace k3::cli
