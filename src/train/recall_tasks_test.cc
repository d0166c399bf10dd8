// The recall-task generators are deterministic and produce what each task defines (checked by
// recomputing the answers independently from the inputs), and the bench runs end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/error.h"
#include "core/parallel.h"
#include "models/registry.h"
#include "train/recall_bench.h"
#include "train/recall_tasks.h"

namespace k3 {

namespace {

RecallTaskOptions opts(RecallTask t, int64_t T, int64_t pairs = 0) {
  RecallTaskOptions o;
  o.task = t;
  o.seq_len = T;
  o.pairs = pairs;
  return resolved(o);
}

}  // namespace

TEST(RecallTasks, DefaultsAndValidation) {
  EXPECT_EQ(opts(RecallTask::Mqar, 128).pairs, 16);
  EXPECT_EQ(opts(RecallTask::Mqar, 256).pairs, 32);
  EXPECT_EQ(opts(RecallTask::Palindrome, 128).pairs, 63);
  EXPECT_EQ(opts(RecallTask::Stack, 128).pairs, 64);
  EXPECT_EQ(opts(RecallTask::Mqar, 128).vocab, 256);
  EXPECT_THROW(opts(RecallTask::Mqar, 64, 32), Error);        // no room for the queries
  EXPECT_THROW(opts(RecallTask::Palindrome, 16, 8), Error);   // 2*8+1 > 16
  RecallTaskOptions o;
  o.vocab = 16;
  o.pairs = 10;  // 7 keys only
  EXPECT_THROW(resolved(o), Error);
  EXPECT_EQ(parse_recall_task("stack"), RecallTask::Stack);
  EXPECT_THROW(parse_recall_task("nope"), Error);
}

TEST(RecallTasks, Deterministic) {
  for (RecallTask t : {RecallTask::Mqar, RecallTask::Palindrome, RecallTask::Stack}) {
    RecallTaskOptions o = opts(t, 96);
    RecallBatch a = make_recall_batch(o, 5, 0, 6), b = make_recall_batch(o, 5, 0, 6);
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_EQ(a.targets, b.targets);
    // Example i of a batch starting at 2 is example 2+i of the stream.
    RecallBatch c = make_recall_batch(o, 5, 2, 4);
    EXPECT_TRUE(std::equal(c.ids.begin(), c.ids.end(), a.ids.begin() + 2 * 96));
    RecallBatch d = make_recall_batch(o, 6, 0, 6);
    EXPECT_NE(a.ids, d.ids);
    // Held-out examples come from a different stream.
    EXPECT_NE(recall_train_seed(1), recall_test_seed(1));
    RecallBatch tr = make_recall_batch(o, recall_train_seed(1), 0, 8), te = make_recall_batch(o, recall_test_seed(1), 0, 8);
    EXPECT_NE(tr.ids, te.ids);
  }
}

TEST(RecallTasks, MqarWellFormed) {
  const RecallTaskOptions o = opts(RecallTask::Mqar, 128);
  const int64_t T = o.seq_len, P = o.pairs, V = o.vocab;
  RecallBatch b = make_recall_batch(o, 42, 0, 200);
  int64_t early = 0, late = 0;
  for (int64_t e = 0; e < b.B; ++e) {
    const int64_t* x = b.ids.data() + e * T;
    const int64_t* y = b.targets.data() + e * T;
    std::map<int64_t, int64_t> kv;
    std::set<int64_t> vals;
    for (int64_t i = 0; i < P; ++i) {
      ASSERT_GE(x[2 * i], 1);
      ASSERT_LT(x[2 * i], V / 2);
      ASSERT_GE(x[2 * i + 1], V / 2);
      ASSERT_LT(x[2 * i + 1], V);
      ASSERT_TRUE(kv.emplace(x[2 * i], x[2 * i + 1]).second) << "duplicate key";
      ASSERT_TRUE(vals.insert(x[2 * i + 1]).second) << "duplicate value";
      ASSERT_EQ(y[2 * i], -1);
      ASSERT_EQ(y[2 * i + 1], -1);
    }
    std::set<int64_t> queried;
    for (int64_t p = 2 * P; p < T; ++p) {
      if (y[p] < 0) {
        // Not a query key: a value right after its key, or filler.
        if (p > 2 * P && y[p - 1] >= 0) ASSERT_EQ(x[p], y[p - 1]);
        else ASSERT_EQ(x[p], 0) << "position " << p;
        continue;
      }
      ASSERT_EQ((p - 2 * P) % 2, 0);
      ASSERT_TRUE(kv.count(x[p])) << "query of a key not in the context";
      ASSERT_EQ(y[p], kv[x[p]]);
      ASSERT_TRUE(queried.insert(x[p]).second) << "key queried twice";
      ((p - 2 * P) / 2 < (T - 2 * P) / 4 ? early : late)++;
    }
    ASSERT_EQ(int64_t(queried.size()), P);
  }
  EXPECT_EQ(b.answers(), b.B * P);
  // Power-law placement: queries crowd the slots nearest the key-value pairs.
  EXPECT_GT(early, late);
}

TEST(RecallTasks, PalindromeWellFormed) {
  const RecallTaskOptions o = opts(RecallTask::Palindrome, 40, 12);
  const int64_t T = o.seq_len, n = o.pairs;
  RecallBatch b = make_recall_batch(o, 3, 0, 50);
  for (int64_t e = 0; e < b.B; ++e) {
    const int64_t* x = b.ids.data() + e * T;
    const int64_t* y = b.targets.data() + e * T;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_GE(x[i], 2);
      ASSERT_LT(x[i], o.vocab);
      ASSERT_EQ(y[i], -1);
    }
    ASSERT_EQ(x[n], 1);
    std::vector<int64_t> rev(x, x + n);
    std::reverse(rev.begin(), rev.end());
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(y[n + j], rev[size_t(j)]);      // answered at <sep> and each reversed token
      ASSERT_EQ(x[n + 1 + j], rev[size_t(j)]);  // the reversed half is the input too
    }
    for (int64_t p = 2 * n; p < T; ++p) ASSERT_EQ(y[p], -1);
    for (int64_t p = 2 * n + 1; p < T; ++p) ASSERT_EQ(x[p], 0);
  }
  EXPECT_EQ(b.answers(), b.B * n);
}

TEST(RecallTasks, StackWellFormed) {
  const RecallTaskOptions o = opts(RecallTask::Stack, 128, 4);  // few stacks: deep stacks
  const int64_t T = o.seq_len, S = o.pairs;
  RecallBatch b = make_recall_batch(o, 9, 0, 50);
  int64_t pops = 0, deep = 0;
  for (int64_t e = 0; e < b.B; ++e) {
    const int64_t* x = b.ids.data() + e * T;
    const int64_t* y = b.targets.data() + e * T;
    std::vector<std::vector<int64_t>> st(static_cast<size_t>(S));
    const int64_t ops = T / 3;
    for (int64_t k = 0; k < ops; ++k) {
      const int64_t op = x[3 * k], id = x[3 * k + 1] - 3, val = x[3 * k + 2];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, S);
      ASSERT_GE(val, 3 + S);
      ASSERT_LT(val, o.vocab);
      ASSERT_EQ(y[3 * k], -1);
      ASSERT_EQ(y[3 * k + 2], -1);
      auto& s = st[size_t(id)];
      if (op == 1) {
        s.push_back(val);
        ASSERT_EQ(y[3 * k + 1], -1);
      } else {
        ASSERT_EQ(op, 2);
        ASSERT_FALSE(s.empty()) << "pop of an empty stack";
        deep += s.size() > 1;
        ASSERT_EQ(y[3 * k + 1], s.back());
        ASSERT_EQ(val, s.back());
        s.pop_back();
        ++pops;
      }
    }
    for (int64_t p = 3 * ops; p < T; ++p) {
      ASSERT_EQ(x[p], 0);
      ASSERT_EQ(y[p], -1);
    }
  }
  EXPECT_EQ(b.answers(), pops);
  EXPECT_GT(pops, 0);
  EXPECT_GT(deep, 0);  // some pops have to skip over a more recent push to another stack
}

// Overwrite and Capacity, replayed independently: a unit whose key position is scored is a query,
// whose target (and fed-back value) is the latest value written for that key; any other unit is a
// write. Overwrite rebinds few keys over and over; Capacity writes fresh keys and asks recent ones.
TEST(RecallTasks, KeyStreamsWellFormed) {
  for (const RecallTask task : {RecallTask::Overwrite, RecallTask::Capacity}) {
    SCOPED_TRACE(recall_task_name(task));
    const RecallTaskOptions o = opts(task, 128);
    const int64_t T = o.seq_len, half = o.vocab / 2;
    RecallBatch b = make_recall_batch(o, 5, 0, 40);
    int64_t queries = 0, rebinds = 0, stale = 0, writes = 0, far = 0;
    for (int64_t e = 0; e < b.B; ++e) {
      const int64_t* x = b.ids.data() + e * T;
      const int64_t* y = b.targets.data() + e * T;
      std::map<int64_t, int64_t> latest;
      std::vector<int64_t> order;  // keys by last write, most recent last
      std::set<int64_t> keys;
      for (int64_t u = 0; u < T / 2; ++u) {
        const int64_t k = x[2 * u], v = x[2 * u + 1];
        ASSERT_GE(k, 1);
        ASSERT_LT(k, half);
        ASSERT_GE(v, half);
        ASSERT_LT(v, o.vocab);
        ASSERT_EQ(y[2 * u + 1], -1);
        if (y[2 * u] >= 0) {
          ++queries;
          ASSERT_TRUE(latest.count(k)) << "a query of a key never written";
          ASSERT_EQ(y[2 * u], latest[k]);
          ASSERT_EQ(v, latest[k]);
          const auto pos = std::find(order.begin(), order.end(), k);
          const int64_t age = int64_t(order.end() - pos) - 1;  // distinct keys written since
          if (task == RecallTask::Capacity) {
            ASSERT_LT(age, o.pairs);
          }
          far += age > 0;
        } else {
          ++writes;
          if (latest.count(k)) {
            ++rebinds;
            stale += latest[k] != v;
            order.erase(std::find(order.begin(), order.end(), k));
          }
          latest[k] = v;
          order.push_back(k);
          keys.insert(k);
        }
      }
      if (task == RecallTask::Overwrite) {
        ASSERT_LE(int64_t(keys.size()), o.pairs);
      }
    }
    EXPECT_EQ(b.answers(), queries);
    EXPECT_GT(queries, 40 * 16);  // about half the units
    EXPECT_GT(far, queries / 2);  // most queries skip over later writes of other keys
    if (task == RecallTask::Overwrite) {
      EXPECT_GT(rebinds, writes / 2);  // 8 keys: most writes rebind one
      EXPECT_GT(stale, rebinds * 9 / 10);
    } else {
      EXPECT_EQ(rebinds, 0);  // 127 keys, 64 units: every write takes a fresh key
    }
  }
  EXPECT_EQ(parse_recall_task("overwrite"), RecallTask::Overwrite);
  EXPECT_EQ(parse_recall_task("capacity"), RecallTask::Capacity);
}

// Niah, replayed: filler in [3, V/2) everywhere but the needles `1 k v` and the final `2 k`,
// scored at that last k with the value of the needle that holds k.
TEST(RecallTasks, NiahWellFormed) {
  const RecallTaskOptions o = opts(RecallTask::Niah, 96, 3);
  const int64_t T = o.seq_len, V = o.vocab;
  RecallBatch b = make_recall_batch(o, 3, 0, 30);
  std::set<int64_t> asked_slots;
  for (int64_t e = 0; e < b.B; ++e) {
    const int64_t* x = b.ids.data() + e * T;
    const int64_t* y = b.targets.data() + e * T;
    std::map<int64_t, std::pair<int64_t, int64_t>> needles;  // key -> (value, position)
    for (int64_t i = 0; i < T - 2; ++i) {
      if (x[i] == 1) {
        ASSERT_LT(i + 2, T - 2);
        const int64_t k = x[i + 1], v = x[i + 2];
        ASSERT_GE(k, V / 2);
        ASSERT_LT(k, V / 2 + V / 4);
        ASSERT_GE(v, V / 2 + V / 4);
        ASSERT_LT(v, V);
        ASSERT_FALSE(needles.count(k)) << "two needles with one key";
        needles[k] = {v, i};
        i += 2;
        continue;
      }
      ASSERT_GE(x[i], 3);
      ASSERT_LT(x[i], V / 2);
      ASSERT_EQ(y[i], -1);
    }
    ASSERT_EQ(int64_t(needles.size()), o.pairs);
    ASSERT_EQ(x[T - 2], 2);
    ASSERT_TRUE(needles.count(x[T - 1]));
    ASSERT_EQ(y[T - 1], needles[x[T - 1]].first);
    asked_slots.insert(needles[x[T - 1]].second / 8);
  }
  EXPECT_EQ(b.answers(), b.B);
  EXPECT_GT(asked_slots.size(), 4u);  // the asked needle sits anywhere in the haystack
  EXPECT_EQ(parse_recall_task("niah"), RecallTask::Niah);
}

// Test accuracy after a CPU smoke run (d_model 16, 150 steps of batch 8) on one thread: no spinning
// against the other tests ctest runs beside it, and the same run whatever the core count.
double smoke_accuracy(RecallTask task, int64_t T, int64_t pairs, int64_t vocab, const std::string& mixer,
                      int64_t test_examples) {
  RecallBenchOptions o;
  o.task.task = task;
  o.task.seq_len = T;
  o.task.pairs = pairs;
  o.task.vocab = vocab;
  o.task = resolved(o.task);
  o.mixer = mixer;
  o.d_model = 16;
  o.steps = 150;
  o.batch = 8;
  o.test_examples = test_examples;
  o.quiet = true;
  const int threads = num_threads();
  set_num_threads(1);
  const double accuracy = run_recall_bench(o).accuracy;
  set_num_threads(threads);
  return accuracy;
}

// DeltaNet learns the overwrite task well past chance (16 values: 1/16); 0.33 when written.
TEST(RecallBench, OverwriteSmokeBeatsChance) {
  EXPECT_GT(smoke_accuracy(RecallTask::Overwrite, 32, 4, 32, "deltanet", 64), 3.0 / 16);
}

// Gated DeltaNet finds the needle well past chance (8 values: 1/8); 0.45 when written.
TEST(RecallBench, NiahSmokeBeatsChance) {
  EXPECT_GT(smoke_accuracy(RecallTask::Niah, 64, 1, 32, "gdn", 128), 2.0 / 8);
}

// The seeds' summary in closed form: accuracies 0.5, 0.75, 1 -> mean 0.75, sample sd 0.25.
TEST(RecallBench, SeedSummaryIsMeanAndSpread) {
  std::vector<RecallResult> runs(3);
  const double acc[3] = {0.5, 1.0, 0.75};
  for (int i = 0; i < 3; ++i) runs[size_t(i)].accuracy = acc[i], runs[size_t(i)].options.seed = uint64_t(10 + i);
  const RecallSeedsResult r = summarize_seeds(runs);
  EXPECT_DOUBLE_EQ(r.mean, 0.75);
  EXPECT_DOUBLE_EQ(r.min, 0.5);
  EXPECT_DOUBLE_EQ(r.max, 1.0);
  EXPECT_NEAR(r.stddev, 0.25, 1e-12);
  const Json j = r.to_json();
  EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), 0.75);
  ASSERT_EQ(j["runs_by_seed"].size(), 3u);
  EXPECT_EQ(j["seeds"][2].get<int64_t>(), 12);
  EXPECT_EQ(summarize_seeds({runs[0]}).stddev, 0.0);
  EXPECT_THROW(run_recall_seeds(RecallBenchOptions{}, {}), Error);
}

TEST(RecallBench, StateElements) {
  // layers x heads x dk x dv for the recurrent mixers; K and V of every token for attention.
  EXPECT_EQ(recall_state_elements(recall_model_config("deltanet", 64, 32, 16), 32), 2 * 2 * 8 * 8);
  EXPECT_EQ(recall_state_elements(recall_model_config("kda", 64, 32, 16), 32), 2 * 2 * 8 * 8);
  EXPECT_EQ(recall_state_elements(recall_model_config("softmax", 64, 32, 16), 32), 2 * 2 * 16 * 32);
  EXPECT_THROW(recall_model_config("mamba", 64, 32, 16), Error);
}

// The controlled comparison: every mixer has the short conv 4 (softmax through k3_short_conv), GDN
// has no output gate (DeltaNet has none) and starts with slow forgetting; lrs per mixer.
TEST(RecallBench, ModelsDifferInTheirMemoryOnly) {
  EXPECT_EQ(recall_model_config("softmax", 64, 32, 16).value("k3_short_conv", 0), 4);
  EXPECT_EQ(recall_model_config("gdn", 64, 32, 16).value("use_gate", true), false);
  EXPECT_EQ(recall_model_config("kda", 64, 32, 16).value("use_gate", true), false);
  auto has = [](const Model& m, std::initializer_list<const char*> parts) {
    bool found = false;
    m.visit([&](const std::string& name, Node&, ParamKind) {
      for (const char* p : parts) found |= name.find(p) != std::string::npos;
    });
    return found;
  };
  for (const std::string mixer : {"softmax", "deltanet", "gdn", "kda"}) {
    auto m = build_model(recall_model_config(mixer, 64, 32, 16), mixer);
    EXPECT_TRUE(has(*m, {"conv"})) << mixer;
    EXPECT_FALSE(has(*m, {"g_proj", "g_a_proj", "g_b_proj"})) << mixer << " has an output gate";
  }
  // use_gate: false is what removes KDA's gate (fla's KDA has one).
  Json kda = recall_model_config("kda", 64, 32, 16);
  kda.erase("use_gate");
  EXPECT_TRUE(has(*build_model(kda, "kda"), {"g_proj"}));
  EXPECT_EQ(default_recall_lr("softmax"), 1e-2f);
  EXPECT_EQ(default_recall_lr("kda"), 3e-3f);
  EXPECT_EQ(default_recall_steps(RecallTask::Mqar), 1500);
}

// The plateau exit: a loss of 4 for 10 steps, then 1. The smoothed loss after n of the steps at
// 1 is 1 + 3 · 0.9ⁿ, below 2 (half of 4) first at n = 11 (3 · 0.9¹⁰ = 1.046, 3 · 0.9¹¹ = 0.941):
// 10 + 11 = 21 steps.
TEST(RecallBench, HalfLossStep) {
  std::vector<double> curve(10, 4.0);
  curve.resize(40, 1.0);
  EXPECT_EQ(half_loss_step(curve), 21);
  EXPECT_EQ(half_loss_step(std::vector<double>(40, 4.0)), -1);  // never leaves the plateau
  EXPECT_EQ(half_loss_step({}), -1);
  // A drop to 0 after the first step: 4 · 0.9ⁿ < 2 first at n = 7 (0.9⁶ = 0.531, 0.9⁷ = 0.478).
  std::vector<double> drop(11, 0.0);
  drop[0] = 4.0;
  EXPECT_EQ(half_loss_step(drop), 8);
}

TEST(RecallBench, SmokeEveryMixer) {
  for (const std::string& mixer : recall_mixers()) {
    RecallBenchOptions o;
    o.task = opts(RecallTask::Mqar, 32, 4);
    o.task.vocab = 32;
    o.mixer = mixer;
    o.d_model = 16;
    o.steps = 3;
    o.batch = 2;
    o.test_examples = 4;
    o.quiet = true;
    RecallResult r = run_recall_bench(o);
    EXPECT_GE(r.accuracy, 0.0) << mixer;
    EXPECT_LE(r.accuracy, 1.0) << mixer;
    EXPECT_EQ(r.runs.size(), 1u);
    EXPECT_GT(r.state_elements, 0);
    EXPECT_TRUE(r.to_json().contains("accuracy"));
    EXPECT_EQ(r.best_lr, default_recall_lr(mixer));
  }
}

}  // namespace k3
