// Checkpoints resume exactly: 20 steps straight and 10 steps + resume + 10 steps give
// bit-identical losses (model, optimizer moments, step, data position all restored).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/random.h"
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

INSTANTIATE_TEST_SUITE_P(Presets, Resume, ::testing::Values("gpt2-tiny", "k3-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) if (c == '-') c = '_';
                           return n;
                         });

}  // namespace k3
