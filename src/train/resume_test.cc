// Checkpoints resume exactly: 20 steps straight and 10 steps + resume + 10 steps give
// bit-identical losses (model, optimizer moments, step, data position all restored), and a run
// folder left in any state a killed save can leave resumes to the same final weights or is
// refused, naming the files that do not belong together.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/random.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace k3 {

namespace fs = std::filesystem;

class Resume : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("k3_resume_" + std::to_string(::getpid()) + "_" + GetParam());
    fs::remove_all(dir);
    fs::create_directories(dir);
    setenv("K3_CACHE_DIR", (dir / "cache").c_str(), 1);
    // A small deterministic corpus of pseudo-words.
    Rng rng(5);
    const char* syll[] = {"ka", "lo", "mi", "re", "tu", "sa", "no", "vi", " ", " ", ", ", ".\n"};
    std::ofstream out(dir / "corpus.txt");
    for (int i = 0; i < 30000; ++i) out << syll[rng.below(12)];
  }
  void TearDown() override { fs::remove_all(dir); }

  TrainConfig config(const std::string& out, int64_t steps) {
    TrainConfig c;
    c.preset = GetParam();
    c.data = {(dir / "corpus.txt").string()};
    c.steps = steps;
    c.decay_steps = 20;
    c.warmup = 3;
    c.batch = 2;
    c.seq_len = 32;
    c.out = (dir / out).string();
    c.sample_tokens = 0;
    c.eval_batches = 1;
    c.quiet = true;
    return c;
  }
  fs::path dir;
};

TEST_P(Resume, TenPlusTenEqualsTwenty) {
  TrainResult straight = run_training(config("straight", 20));
  TrainResult first = run_training(config("split", 10));
  TrainConfig rc = config("", 20);
  rc.out.clear();
  rc.resume = (dir / "split").string();
  rc.preset = "";  // comes from the checkpoint
  TrainResult second = run_training(rc);
  ASSERT_EQ(straight.losses.size(), 20u);
  ASSERT_EQ(first.losses.size(), 10u);
  ASSERT_EQ(second.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(first.losses[i], straight.losses[i]) << "step " << i;
    EXPECT_EQ(second.losses[i], straight.losses[10 + i]) << "step " << 10 + i;
  }
  // metrics.jsonl of the resumed run holds all 20 steps.
  std::ifstream m(dir / "split" / "metrics.jsonl");
  int lines = 0;
  for (std::string l; std::getline(m, l);) ++lines;
  EXPECT_EQ(lines, 20);
  EXPECT_TRUE(fs::exists(dir / "split" / "loss.svg"));
}

// The bytes of a file (whole-file comparison of final weights).
std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST_P(Resume, EveryTornSaveRecoversOrIsRefused) {
  run_training(config("straight", 20));
  const std::string want_model = slurp(dir / "straight" / "model.safetensors");
  const std::string want_opt = slurp(dir / "straight" / "optimizer.safetensors");
  ASSERT_GT(want_model.size(), 1000u);

  // Two checkpoints (steps 10 and 20), both kept.
  TrainConfig both = config("run", 20);
  both.save_every = 10;
  both.keep_checkpoints = 0;
  run_training(both);
  const fs::path run = dir / "run";
  ASSERT_TRUE(fs::is_directory(run / "checkpoint-10"));
  ASSERT_TRUE(fs::is_directory(run / "checkpoint-20"));
  EXPECT_EQ(fs::read_symlink(run / "latest").string(), "checkpoint-20");
  EXPECT_EQ(slurp(run / "model.safetensors"), want_model);  // the run folder reads as the latest checkpoint

  auto resume_from = [&](const fs::path& where) {
    TrainConfig rc = config("", 20);
    rc.out.clear();
    rc.preset = "";
    rc.resume = where.string();
    return run_training(rc);
  };
  auto backup = dir / "backup";
  fs::copy(run, backup, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  auto restore = [&] {
    fs::remove_all(run);
    fs::copy(backup, run, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  };

  // 1. Killed while writing the step-20 checkpoint: its temporary folder and a half-written
  //    safetensors file lie beside the published step 10.
  restore();
  fs::remove_all(run / "checkpoint-20");
  fs::remove(run / "latest");
  fs::create_directory_symlink("checkpoint-10", run / "latest");
  fs::create_directories(run / ".checkpoint-20.tmp-999999");
  std::ofstream(run / ".checkpoint-20.tmp-999999" / "model.safetensors") << "partial";
  std::ofstream(run / "model.safetensors.tmp.999999") << "partial";
  TrainResult r1 = resume_from(run);
  EXPECT_EQ(r1.losses.size(), 10u);
  EXPECT_EQ(slurp(run / "model.safetensors"), want_model);
  EXPECT_EQ(slurp(run / "optimizer.safetensors"), want_opt);
  EXPECT_FALSE(fs::exists(run / ".checkpoint-20.tmp-999999"));
  EXPECT_FALSE(fs::exists(run / "model.safetensors.tmp.999999"));
  EXPECT_FALSE(fs::exists(run / "checkpoint-10")) << "the default keeps one checkpoint";

  // 2. Killed after checkpoint-20 was renamed into place but before `latest` moved to it.
  restore();
  fs::remove(run / "latest");
  fs::create_directory_symlink("checkpoint-10", run / "latest");
  TrainResult r2 = resume_from(run);
  EXPECT_EQ(r2.losses.size(), 10u);
  EXPECT_EQ(slurp(run / "model.safetensors"), want_model);

  // 3. Killed before the first `latest` was written: the newest complete checkpoint is used.
  restore();
  fs::remove(run / "latest");
  fs::remove_all(run / "checkpoint-20");
  TrainResult r3 = resume_from(run);
  EXPECT_EQ(r3.losses.size(), 10u);
  EXPECT_EQ(slurp(run / "model.safetensors"), want_model);

  // 4. Resuming from one checkpoint folder by name.
  restore();
  TrainResult r4 = resume_from(run / "checkpoint-10");
  EXPECT_EQ(r4.losses.size(), 10u);
  EXPECT_EQ(slurp(run / "model.safetensors"), want_model);

  // 5. Files of different steps in one folder are refused, each named.
  restore();
  fs::copy_file(run / "checkpoint-20" / "model.safetensors", run / "checkpoint-10" / "model.safetensors",
                fs::copy_options::overwrite_existing);
  fs::remove(run / "checkpoint-10" / "optimizer.safetensors");
  try {
    resume_from(run / "checkpoint-10");
    ADD_FAILURE() << "a mixed checkpoint resumed";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("not one unit"), std::string::npos) << m;
    EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("optimizer.safetensors (missing)"), std::string::npos) << m;
    EXPECT_EQ(m.find("config.json"), std::string::npos) << m;
  }

  // 6. A checkpoint whose files were replaced one by one (no manifest, as older k3 wrote) is refused.
  restore();
  fs::path legacy = dir / "legacy";
  fs::create_directories(legacy);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors"})
    fs::copy_file(run / "checkpoint-20" / f, legacy / f);
  Json st = read_json_file((run / "checkpoint-20" / "trainer_state.json").string());
  st.erase("files");
  std::ofstream(legacy / "trainer_state.json") << st.dump();
  EXPECT_THROW(resume_from(legacy), Error);

  // 7. A fresh run never writes over an earlier run's folder unless asked to.
  TrainConfig again = config("run", 20);
  EXPECT_THROW(run_training(again), Error);
  again.overwrite = true;
  again.steps = 2;
  run_training(again);
  EXPECT_EQ(fs::read_symlink(run / "latest").string(), "checkpoint-2");
  EXPECT_FALSE(fs::exists(run / "checkpoint-20"));
}

TEST(Checkpoint, PublishReplacesLatestAtomicallyAndPrunes) {
  const fs::path run = fs::temp_directory_path() / ("k3_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run);
  auto write = [&](int64_t step, int keep) {
    std::string tmp = begin_checkpoint(run.string(), step);
    for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors"})
      std::ofstream(fs::path(tmp) / f) << f << " of step " << step;
    return publish_checkpoint(run.string(), tmp, step, Json{{"preset", "x"}}, CheckpointWriteOptions{keep});
  };
  write(1, 2);
  write(2, 2);
  write(3, 2);
  EXPECT_FALSE(fs::exists(run / "checkpoint-1"));
  EXPECT_TRUE(fs::exists(run / "checkpoint-2"));
  EXPECT_EQ(latest_checkpoint(run.string()), (run / "checkpoint-3").string());
  EXPECT_EQ(slurp(run / "config.json"), "config.json of step 3");
  OpenedCheckpoint c = open_checkpoint(run.string());
  EXPECT_EQ(c.step, 3);
  EXPECT_EQ(c.run_dir, run.string());
  // The same step saved again (a run resumed from an earlier checkpoint) replaces it in place.
  std::string tmp = begin_checkpoint(run.string(), 3);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors"})
    std::ofstream(fs::path(tmp) / f) << "again";
  publish_checkpoint(run.string(), tmp, 3, Json::object(), CheckpointWriteOptions{2});
  EXPECT_EQ(slurp(run / "model.safetensors"), "again");
  EXPECT_EQ(open_checkpoint(run.string()).step, 3);
  // A file changed after the save is caught by its content, not only its size.
  std::ofstream(run / "checkpoint-3" / "tokenizer.json", std::ios::trunc) << "AGAIN";
  EXPECT_THROW(open_checkpoint(run.string()), Error);
  // Stale temporaries go.
  fs::create_directories(run / ".checkpoint-4.tmp-1");
  std::ofstream(run / "optimizer.safetensors.tmp.77") << "x";
  EXPECT_EQ(remove_stale_temporaries(run.string()), 2);
  {
    RunDirLock lock(run.string());
    EXPECT_THROW(RunDirLock again(run.string()), Error);
  }
  RunDirLock after(run.string());  // released with the first
  fs::remove_all(run);
}

INSTANTIATE_TEST_SUITE_P(Presets, Resume, ::testing::Values("gpt2-tiny", "k3-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });

}  // namespace k3
