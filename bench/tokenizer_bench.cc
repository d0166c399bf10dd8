// Tokenizer throughput on one core: encode MB/s on generated English-like prose (target: 5 MB/s),
// on the multilingual / invalid-UTF-8 golden texts, and decode. The GPT-2 files are read from
// $K3_SHARED_DIR/data/gpt2 (environment variable, else the compile definition K3_SHARED_DIR).
#include <benchmark/benchmark.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/random.h"
#include "gpt2_tokenizer.h"
#include "tokenizer/bpe.h"

#ifndef K3_SOURCE_DIR
#define K3_SOURCE_DIR "."
#endif

namespace {

constexpr double kTargetMBps = 5.0;
constexpr size_t kCorpusBytes = 4 << 20;

const k3::Tokenizer& gpt2() { return gpt2_tokenizer(); }

// Deterministic English-like prose: common words with Zipf-like frequencies, sentences,
// paragraphs, numbers, contractions and some punctuation.
std::string english_corpus(size_t bytes) {
  static const char* const kWords[] = {
      "the", "of", "and", "to", "a", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with",
      "as", "I", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word",
      "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your",
      "how", "said", "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many",
      "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him",
      "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most",
      "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been",
      "now", "find", "government", "language", "tokenizer", "committee", "extraordinary", "measurement",
      "nevertheless", "understanding", "responsibility", "international", "development", "particularly"};
  static const char* const kContractions[] = {"don't", "it's", "we'll", "they're", "I've", "she'd", "can't"};
  constexpr size_t n_words = sizeof(kWords) / sizeof(kWords[0]);
  k3::Rng rng(42);
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    const size_t sentences = 2 + rng.below(6);
    for (size_t s = 0; s < sentences; ++s) {
      const size_t words = 5 + rng.below(20);
      for (size_t w = 0; w < words; ++w) {
        // Zipf-like: the square of a uniform favours the front of the list.
        const double u = rng.uniform_double();
        std::string word = kWords[size_t(u * u * n_words)];
        if (rng.below(40) == 0) word = kContractions[rng.below(7)];
        if (rng.below(60) == 0) word = std::to_string(rng.below(100000));
        if (w == 0) word[0] = char(std::toupper(word[0]));
        out += word;
        if (w + 1 < words) out += rng.below(12) == 0 ? ", " : " ";
      }
      static const char* const kEnds[] = {". ", ". ", ". ", "? ", "! ", "; "};
      out += kEnds[rng.below(6)];
    }
    out += rng.below(4) == 0 ? "\n\n" : "\n";
  }
  return out;
}

std::string golden_corpus(size_t bytes) {
  std::ifstream in(std::string(K3_SOURCE_DIR) + "/tests/data/tokenizer/goldens.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json doc = nlohmann::json::parse(ss.str());
  std::string all;
  for (const auto& c : doc["cases"]) {
    const std::string b64 = c["bytes_b64"].get<std::string>();
    uint32_t acc = 0;
    int bits = 0;
    for (const char ch : b64) {
      const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      const char* p = ch ? std::strchr(table, ch) : nullptr;
      if (!p) break;
      acc = (acc << 6) | uint32_t(p - table);
      if ((bits += 6) >= 8) all += char((acc >> (bits -= 8)) & 0xFF);
    }
  }
  std::string out;
  while (!all.empty() && out.size() < bytes) out += all;
  return out;
}

const std::string& english() {
  static const std::string text = english_corpus(kCorpusBytes);
  return text;
}

void BM_EncodeEnglish(benchmark::State& state) {
  const std::string& text = english();
  for (auto _ : state) benchmark::DoNotOptimize(gpt2().encode(text));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
}

void BM_EncodeGoldenTexts(benchmark::State& state) {
  static const std::string text = golden_corpus(kCorpusBytes / 2);
  for (auto _ : state) benchmark::DoNotOptimize(gpt2().encode(text));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
}

void BM_DecodeEnglish(benchmark::State& state) {
  const std::vector<int32_t> ids = gpt2().encode(english());
  for (auto _ : state) benchmark::DoNotOptimize(gpt2().decode(ids));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(english().size()));
}

BENCHMARK(BM_EncodeEnglish)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(BM_EncodeGoldenTexts)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeEnglish)->Unit(benchmark::kMillisecond);

// Prints the usual table, and then whether English encoding meets the target.
class TargetReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const auto it = r.counters.find("bytes_per_second");
      if (r.run_name.function_name == "BM_EncodeEnglish" && it != r.counters.end()) english_mbps = it->second / 1e6;
    }
  }
  double english_mbps = -1;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("English-like corpus: %zu bytes, %zu GPT-2 tokens\n", english().size(), gpt2().encode(english()).size());
  TargetReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  if (reporter.english_mbps >= 0)
    std::printf("encode English: %.1f MB/s (10^6 bytes) on one core; target %.0f MB/s: %s\n", reporter.english_mbps, kTargetMBps,
                reporter.english_mbps >= kTargetMBps ? "MET" : "NOT MET");
  benchmark::Shutdown();
  return 0;
}
