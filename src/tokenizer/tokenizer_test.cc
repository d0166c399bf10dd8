#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/random.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/split.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kGpt2Dir = std::string(K3_SHARED_DIR) + "/data/gpt2";
const std::string kGoldens = std::string(K3_SOURCE_DIR) + "/tests/data/tokenizer/goldens.json";

const Tokenizer& gpt2() {
  static const Tokenizer tok = Tokenizer::from_gpt2_files(kGpt2Dir + "/encoder.json", kGpt2Dir + "/vocab.bpe");
  return tok;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

using tok::base64_decode;

struct Golden {
  std::string name, bytes;
  bool utf8 = true;
  std::vector<int32_t> ids, ids_ordinary;
};

const std::vector<Golden>& goldens() {
  static const std::vector<Golden> cases = [] {
    std::vector<Golden> out;
    const json doc = json::parse(slurp(kGoldens));
    for (const json& c : doc["cases"]) {
      Golden g;
      g.name = c["name"].get<std::string>();
      g.bytes = base64_decode(c["bytes_b64"].get<std::string>());
      g.utf8 = c["utf8"].get<bool>();
      g.ids = c["ids"].get<std::vector<int32_t>>();
      g.ids_ordinary = c.contains("ids_ordinary") ? c["ids_ordinary"].get<std::vector<int32_t>>() : g.ids;
      out.push_back(std::move(g));
    }
    return out;
  }();
  return cases;
}

// A fresh folder per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("k3_tokenizer_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void expect_same_on_goldens(const Tokenizer& tok) {
  for (const Golden& g : goldens()) {
    ASSERT_EQ(tok.encode(g.bytes), g.ids) << g.name;
    ASSERT_EQ(tok.encode_ordinary(g.bytes), g.ids_ordinary) << g.name;
  }
}

// Expects a k3::Error whose message contains every one of `parts`.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string_view> parts) {
  try {
    f();
    ADD_FAILURE() << "no k3::Error thrown";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.component(), "tokenizer") << what;
    for (std::string_view p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
  }
}

// ---- exactness ---------------------------------------------------------------------------------

TEST(Tokenizer, Gpt2Basics) {
  const Tokenizer& tok = gpt2();
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eos_id(), 50256);
  EXPECT_EQ(tok.special_id("<|endoftext|>"), 50256);
  EXPECT_EQ(tok.special_id("<|nothing|>"), std::nullopt);
  EXPECT_EQ(tok.token_bytes(50256), "<|endoftext|>");
  EXPECT_EQ(tok.token_bytes(198), "\n");
  EXPECT_EQ(tok.token_bytes(220), " ");
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok.encode(""), std::vector<int32_t>{});
}

TEST(Tokenizer, GoldensMatchTiktoken) {
  ASSERT_GT(goldens().size(), 600u);
  size_t invalid = 0;
  for (const Golden& g : goldens()) {
    EXPECT_EQ(gpt2().encode(g.bytes), g.ids) << g.name;
    EXPECT_EQ(gpt2().encode_ordinary(g.bytes), g.ids_ordinary) << g.name;
    EXPECT_EQ(gpt2().decode(g.ids), g.bytes) << g.name;
    invalid += !g.utf8;
  }
  EXPECT_GT(invalid, 300u);
}

TEST(Tokenizer, EncodeIntoAppends) {
  std::vector<int32_t> ids{7};
  gpt2().encode_into("Hello<|endoftext|>", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 15496, 50256}));
  gpt2().encode_ordinary_into(" world", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 15496, 50256, 995}));
}

TEST(Tokenizer, Base64MatchesRfc4648Vectors) {
  EXPECT_EQ(base64_decode("Zg=="), "f");
  EXPECT_EQ(base64_decode("Zm8="), "fo");
  EXPECT_EQ(base64_decode("Zm9v"), "foo");
  EXPECT_EQ(base64_decode("Zm9vYmFy"), "foobar");
  EXPECT_EQ(base64_decode("/w=="), "\xff");
  EXPECT_EQ(base64_decode("Zm9"), "");    // not a multiple of 4
  EXPECT_EQ(base64_decode("Zm=v"), "");   // '=' before the end
  EXPECT_EQ(base64_decode("Zm9!"), "");   // not base64
}

TEST(Tokenizer, EncodeIntoStopsPastALimit) {
  const std::string text = slurp(kGoldens);  // any long text: the goldens file is one
  const std::vector<int32_t> full = gpt2().encode(text + "<|endoftext|>" + text);
  for (size_t limit : {size_t(0), size_t(1), size_t(37), full.size() / 2, full.size() - 1, full.size()}) {
    std::vector<int32_t> part;
    gpt2().encode_into(text + "<|endoftext|>" + text, part, limit);
    // A prefix of the whole encoding, over the limit (by at most one pre-token's ids) unless the
    // whole text fits.
    ASSERT_LE(part.size(), full.size());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), full.begin())) << limit;
    if (limit >= full.size()) {
      EXPECT_EQ(part.size(), full.size());
    } else {
      EXPECT_GT(part.size(), limit);
      EXPECT_LT(part.size(), limit + 64);
    }
  }
}

TEST(Pretokenize, Gpt2Pattern) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(tok::split_gpt2("Hello world's  end  "), (V{"Hello", " world", "'s", " ", " end", "  "}));
  EXPECT_EQ(tok::split_gpt2("I'LL 'll x"), (V{"I", "'", "LL", " '", "ll", " x"}));
  EXPECT_EQ(tok::split_gpt2("a\t\tb \tc"), (V{"a", "\t", "\t", "b", " ", "\t", "c"}));
}

TEST(Pretokenize, CharClasses) {
  using tok::CharClass;
  EXPECT_EQ(tok::char_class('a'), CharClass::kLetter);
  EXPECT_EQ(tok::char_class(0x01C5), CharClass::kLetter);   // Lt
  EXPECT_EQ(tok::char_class(0x02B0), CharClass::kLetter);   // Lm
  EXPECT_EQ(tok::char_class(0x4E2D), CharClass::kLetter);   // Lo
  EXPECT_EQ(tok::char_class(0x2167), CharClass::kNumber);   // Nl
  EXPECT_EQ(tok::char_class(0x00BD), CharClass::kNumber);   // No
  EXPECT_EQ(tok::char_class(0x1D7CE), CharClass::kNumber);  // Nd outside the BMP
  EXPECT_EQ(tok::char_class(0x0085), CharClass::kSpace);
  EXPECT_EQ(tok::char_class(0x3000), CharClass::kSpace);
  EXPECT_EQ(tok::char_class(0x200B), CharClass::kOther);  // zero width space is not White_Space
  EXPECT_EQ(tok::char_class(0x0301), CharClass::kOther);  // combining mark
  EXPECT_EQ(tok::char_class(0x1F600), CharClass::kOther);
}

TEST(Pretokenize, Utf8Helpers) {
  uint32_t cp = 0;
  EXPECT_EQ(tok::utf8_sequence_at("\xE2\x82\xAC", 0, &cp), 3u);
  EXPECT_EQ(cp, 0x20ACu);
  EXPECT_EQ(tok::utf8_sequence_at("\xE0\x80\x80", 0, &cp), 0u);      // overlong
  EXPECT_EQ(tok::utf8_sequence_at("\xED\xA0\x80", 0, &cp), 0u);      // surrogate
  EXPECT_EQ(tok::utf8_sequence_at("\xF4\x90\x80\x80", 0, &cp), 0u);  // above U+10FFFF
  EXPECT_EQ(tok::utf8_sequence_at("\xF0\x9F\x98", 0, &cp), 0u);      // truncated
  EXPECT_EQ(tok::utf8_incomplete_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(tok::utf8_incomplete_tail("ab\xE2"), 1u);
  EXPECT_EQ(tok::utf8_incomplete_tail("ab\xE2\x82\xAC"), 0u);
  EXPECT_EQ(tok::utf8_incomplete_tail("ab\xE0\x80"), 0u);  // can never complete
  EXPECT_EQ(tok::utf8_incomplete_tail("ab\xFF"), 0u);
  EXPECT_EQ(tok::utf8_incomplete_tail("\x80\x80\x80"), 0u);
}

TEST(Tokenizer, RoundTripsRandomBytes) {
  Rng rng(1234);
  const std::string alphabet = "ab c'sl\t\n0<|>";
  for (int i = 0; i < 3000; ++i) {
    std::string s(rng.below(i % 10 == 0 ? 600 : 40), '\0');
    const int mode = i % 4;
    for (char& c : s) {
      const uint64_t r = rng.next_u64();
      if (mode == 0) c = char(r & 0xFF);                                         // uniform bytes
      else if (mode == 1) c = char(0x80 | (r & 0x7F));                           // high bytes only
      else if (mode == 2) c = alphabet[r % alphabet.size()];                     // ASCII soup
      else c = (r & 1) ? char(0xC0 | ((r >> 8) & 0x3F)) : char(0x80 | ((r >> 8) & 0x3F));  // lead/cont
    }
    if (i % 50 == 0) s += "<|endoftext|>" + s;
    EXPECT_EQ(gpt2().decode(gpt2().encode(s)), s) << i;
    EXPECT_EQ(gpt2().decode(gpt2().encode_ordinary(s)), s) << i;
  }
}

TEST(Tokenizer, ConcurrentEncode) {
  std::vector<std::vector<int32_t>> results(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      for (const Golden& g : goldens()) {
        const auto ids = gpt2().encode(g.bytes);
        results[t].insert(results[t].end(), ids.begin(), ids.end());
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(results[0], results[1]);
}

TEST(StreamDecoder, HoldsBackPartialCharacters) {
  for (const Golden& g : goldens()) {
    StreamDecoder dec(gpt2());
    std::string printed;
    for (int32_t id : g.ids) {
      const std::string part = dec.push(id);
      if (g.utf8) {
        EXPECT_EQ(tok::utf8_incomplete_tail(part), 0u) << g.name;
      }
      printed += part;
    }
    printed += dec.flush();
    EXPECT_EQ(printed, g.bytes) << g.name;
  }
  // "€" takes more than one GPT-2 token: nothing comes out until the character is complete.
  const std::vector<int32_t> euro = gpt2().encode("\xE2\x82\xAC");
  StreamDecoder dec(gpt2());
  std::string out;
  for (size_t i = 0; i < euro.size(); ++i) {
    out += dec.push(euro[i]);
    if (i + 1 < euro.size()) {
      EXPECT_EQ(out.size(), 0u);
    }
  }
  EXPECT_EQ(out, "\xE2\x82\xAC");
  EXPECT_EQ(dec.flush(), "");
  expect_error([&] { dec.push(50257); }, {"token id 50257"});
}

// ---- loaders and saving ------------------------------------------------------------------------

TEST(TokenizerFiles, HfVocabMergesEqualsGpt2Files) {
  TempDir dir;
  fs::copy_file(kGpt2Dir + "/encoder.json", dir.file("vocab.json"));
  fs::copy_file(kGpt2Dir + "/vocab.bpe", dir.file("merges.txt"));
  expect_same_on_goldens(Tokenizer::from_hf_vocab_merges(dir.file("vocab.json"), dir.file("merges.txt")));
  const Tokenizer from_dir = Tokenizer::from_dir(dir.path().string());
  EXPECT_EQ(from_dir.eos_id(), 50256);
  expect_same_on_goldens(from_dir);
}

// A tokenizer.json as transformers writes it for GPT-2 (<|endoftext|> as added token `eot_id`).
json tokenizer_json(json vocab, json merges, int eot_id) {
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", {{{"id", eot_id}, {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                             {"rstrip", false}, {"normalized", true}, {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
          {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                     {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false},
                     {"vocab", std::move(vocab)}, {"merges", std::move(merges)}}}};
}

// GPT-2's own files as tokenizer.json, merges in either form.
json hf_gpt2_tokenizer_json(bool merges_as_arrays) {
  json merges = json::array();
  std::istringstream lines(slurp(kGpt2Dir + "/vocab.bpe"));
  std::string line;
  std::getline(lines, line);  // #version
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (merges_as_arrays) merges.push_back({line.substr(0, sp), line.substr(sp + 1)});
    else merges.push_back(line);
  }
  return tokenizer_json(json::parse(slurp(kGpt2Dir + "/encoder.json")), merges, 50256);
}

// A tokenizer.json of the same shape with a tiny vocabulary: the 256 bytes, "Ġt", "he", "Ġthe"
// and <|endoftext|>. Cheap enough to vary for every error case.
json tiny_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[tok::byte_level_encode(std::string(1, char(b)))] = b;
  vocab["\xC4\xA0t"] = 256;
  vocab["he"] = 257;
  vocab["\xC4\xA0the"] = 258;
  vocab["<|endoftext|>"] = 259;
  return tokenizer_json(vocab, {"\xC4\xA0 t", {"h", "e"}, "\xC4\xA0t he"}, 259);
}

TEST(TokenizerFiles, TinyTokenizerJson) {
  TempDir dir;
  spit(dir.path() / "tokenizer.json", tiny_tokenizer_json().dump());
  const Tokenizer t = Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json"));
  EXPECT_EQ(t.vocab_size(), 260);
  EXPECT_EQ(t.eos_id(), 259);
  EXPECT_EQ(t.encode(" the theme<|endoftext|>"), (std::vector<int32_t>{258, 258, 'm', 'e', 259}));
}

TEST(TokenizerFiles, HfTokenizerJsonEqualsGpt2Files) {
  TempDir dir;
  spit(dir.path() / "strings.json", hf_gpt2_tokenizer_json(false).dump());
  spit(dir.path() / "arrays.json", hf_gpt2_tokenizer_json(true).dump());
  const Tokenizer a = Tokenizer::from_hf_tokenizer_json(dir.file("strings.json"));
  expect_same_on_goldens(a);
  EXPECT_EQ(a.eos_id(), 50256);
  EXPECT_EQ(a.vocab_size(), 50257);
  expect_same_on_goldens(Tokenizer::from_hf_tokenizer_json(dir.file("arrays.json")));

  // The Split + ByteLevel(use_regex=false) spelling of the same pre-tokenizer.
  json seq = hf_gpt2_tokenizer_json(false);
  seq["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "'(?:[sdmt]|ll|ve|re)| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"}}},
         {"behavior", "Isolated"}, {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  spit(dir.path() / "tokenizer.json", seq.dump());
  spit(dir.path() / "tokenizer_config.json", R"({"eos_token": {"content": "<|endoftext|>"}})");
  const Tokenizer d = Tokenizer::from_dir(dir.path().string());
  EXPECT_EQ(d.eos_id(), 50256);
  EXPECT_EQ(d.encode("Hello world's"), gpt2().encode("Hello world's"));
}

TEST(TokenizerFiles, SaveRoundTrips) {
  TempDir dir;
  gpt2().save_hf_tokenizer_json(dir.file("tokenizer.json"));
  const Tokenizer back = Tokenizer::from_dir(dir.path().string());
  EXPECT_EQ(back.vocab_size(), gpt2().vocab_size());
  EXPECT_EQ(back.eos_id(), 50256);
  expect_same_on_goldens(back);
  const json saved = json::parse(slurp(dir.file("tokenizer.json")));
  EXPECT_EQ(saved["model"]["type"], "BPE");
  EXPECT_EQ(saved["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(saved["decoder"]["type"], "ByteLevel");
  EXPECT_EQ(saved["model"]["merges"].size(), 50000u);
  EXPECT_EQ(saved["model"]["merges"][0], "\xC4\xA0 t");  // "Ġ t"
  EXPECT_EQ(saved["model"]["vocab"]["\xC4\xA0the"], 262);

  // Saving what was loaded from the saved file gives the same file.
  back.save_hf_tokenizer_json(dir.file("again.json"));
  EXPECT_EQ(slurp(dir.file("again.json")), slurp(dir.file("tokenizer.json")));
}

TEST(TokenizerFiles, FromVocabTinyModel) {
  // A trainer's output: bytes, merges "a"+"b" -> "ab", "ab"+"c" -> "abc", one special.
  BpeVocab v;
  for (int b = 0; b < 256; ++b) v.tokens.emplace_back(std::string(1, char(b)), b);
  v.tokens.emplace_back("ab", 256);
  v.tokens.emplace_back("abc", 257);
  v.merges = {{"a", "b"}, {"ab", "c"}};
  v.specials = {{"<eos>", 258}};
  const Tokenizer t = Tokenizer::from_vocab(v);
  EXPECT_EQ(t.eos_id(), 258);
  EXPECT_EQ(t.encode("abcab<eos>x"), (std::vector<int32_t>{257, 256, 258, 'x'}));
  EXPECT_EQ(t.encode_ordinary("<eos>"), (std::vector<int32_t>{'<', 'e', 'o', 's', '>'}));
  EXPECT_EQ(t.decode({257, 258}), "abc<eos>");
  TempDir dir;
  t.save_hf_tokenizer_json(dir.file("tokenizer.json"));
  const Tokenizer back = Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json"));
  EXPECT_EQ(back.encode("abcab<eos>x \xFF"), t.encode("abcab<eos>x \xFF"));
  EXPECT_EQ(back.to_vocab().merges, v.merges);
}

// ---- errors ------------------------------------------------------------------------------------

TEST(TokenizerErrors, MissingFiles) {
  TempDir dir;
  expect_error([&] { Tokenizer::from_gpt2_files(dir.file("encoder.json"), dir.file("vocab.bpe")); },
               {"cannot open", "encoder.json"});
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json")); }, {"tokenizer.json"});
  expect_error([&] { Tokenizer::from_dir(dir.path().string()); },
               {"no tokenizer in", "tokenizer.json", "vocab.json + merges.txt", "encoder.json + vocab.bpe"});
  expect_error([&] { Tokenizer::from_dir(dir.file("nope")); }, {"not a folder"});
  fs::copy_file(kGpt2Dir + "/encoder.json", dir.file("vocab.json"));
  expect_error([&] { Tokenizer::from_hf_vocab_merges(dir.file("vocab.json"), dir.file("merges.txt")); },
               {"cannot open", "merges.txt"});
}

TEST(TokenizerErrors, TruncatedJson) {
  TempDir dir;
  const std::string enc = slurp(kGpt2Dir + "/encoder.json");
  spit(dir.path() / "encoder.json", enc.substr(0, enc.size() / 2));
  expect_error([&] { Tokenizer::from_gpt2_files(dir.file("encoder.json"), kGpt2Dir + "/vocab.bpe"); },
               {"encoder.json", "not valid JSON"});
  const std::string tj = tiny_tokenizer_json().dump();
  spit(dir.path() / "tokenizer.json", tj.substr(0, tj.size() - 100));
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json")); }, {"not valid JSON"});
  spit(dir.path() / "empty.json", "");
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("empty.json")); }, {"not valid JSON"});
}

TEST(TokenizerErrors, BadMerges) {
  TempDir dir;
  spit(dir.path() / "merges.txt", "#version: 0.2\n\xC4\xA0 t\nzzqq t\n");
  expect_error([&] { Tokenizer::from_gpt2_files(kGpt2Dir + "/encoder.json", dir.file("merges.txt")); },
               {"merges.txt:3", "zzqq", "not in the vocabulary"});
  spit(dir.path() / "merges.txt", "#version: 0.2\nnospace\n");
  expect_error([&] { Tokenizer::from_gpt2_files(kGpt2Dir + "/encoder.json", dir.file("merges.txt")); },
               {"merges.txt:2", "expected a merge"});
  json tj = tiny_tokenizer_json();
  tj["model"]["merges"][1] = {"t", "\xE2\x82\xAC\xE2\x82\xAC"};
  spit(dir.path() / "tokenizer.json", tj.dump());
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json")); }, {"merges[1]", "not in the vocabulary"});
  tj["model"]["merges"][1] = {"h", "\xC4\xA0"};  // both known, but "hĠ" is not a token
  spit(dir.path() / "tokenizer.json", tj.dump());
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json")); }, {"merges[1]", "makes"});
  tj["model"]["merges"][1] = 42;
  spit(dir.path() / "tokenizer.json", tj.dump());
  expect_error([&] { Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json")); }, {"merges[1]", "expected"});
}

TEST(TokenizerErrors, UnsupportedTokenizerJson) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  auto with = [&](const std::function<void(json&)>& edit) {
    json tj = tiny_tokenizer_json();
    edit(tj);
    spit(path, tj.dump());
    return [path] { Tokenizer::from_hf_tokenizer_json(path); };
  };
  expect_error(with([](json& j) { j["model"] = {{"type", "WordPiece"}, {"vocab", json::object()}}; }),
               {path, "WordPiece", "only byte-level BPE"});
  expect_error(with([](json& j) { j["model"] = {{"type", "Unigram"}, {"vocab", json::array()}}; }), {"Unigram"});
  expect_error(with([](json& j) { j.erase("model"); }), {"no \"model\""});
  expect_error(with([](json& j) { j["normalizer"] = {{"type", "Precompiled"}}; }), {"normalizer", "Precompiled"});
  expect_error(with([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }), {"pre_tokenizer", "Metaspace"});
  expect_error(with([](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; }), {"add_prefix_space"});
  expect_error(with([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Sequence"},
                                       {"pretokenizers",
                                        {{{"type", "Split"}, {"pattern", {{"Regex", "[\\p{N}{1,3}"}}}, {"behavior", "Isolated"}},
                                         {{"type", "ByteLevel"}, {"use_regex", false}}}}};
               }),
               {"[\\p{N}{1,3}", "does not compile"});
  expect_error(with([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
               }),
               {"Sideways"});
  expect_error(with([](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }), {"decoder"});
  expect_error(with([](json& j) { j["model"]["byte_fallback"] = true; }), {"byte_fallback"});
  expect_error(with([](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }), {"continuing_subword_prefix"});
  expect_error(with([](json& j) { j["model"]["vocab"]["\xC4\xA0the"] = "x"; }), {"expected a non-negative integer"});
  expect_error(with([](json& j) { j["model"]["vocab"]["\xE2\x82\xAC"] = 50300; }), {"not a byte-level string"});
  expect_error(with([](json& j) { j["model"]["vocab"].erase("\xC4\xA0"); }), {"not in the vocabulary"});
  expect_error(with([](json& j) { j["model"]["vocab"].erase("!"); }), {"0x21", "256 bytes"});
  expect_error(with([](json& j) { j["model"]["vocab"]["\xC4\xA0the"] = 0; }), {"share id 0"});
  expect_error(with([](json& j) { j["model"]["vocab"]["\xC4\xA0the"] = 2000000000; }), {"outside"});
  expect_error(with([](json& j) { j["added_tokens"][0]["id"] = 262; }), {"added token", "<|endoftext|>"});
  expect_error(with([](json& j) { j["added_tokens"][0].erase("content"); }), {"added_tokens entry"});
  expect_error(with([](json& j) { j["model"]["type"] = 3; }), {"unexpected tokenizer.json structure"});
  expect_error(with([](json& j) { j = json::array(); }), {"no \"model\""});
}

TEST(TokenizerErrors, BadVocab) {
  BpeVocab v;
  for (int b = 0; b < 255; ++b) v.tokens.emplace_back(std::string(1, char(b)), b);
  expect_error([&] { Tokenizer::from_vocab(v, "my vocab"); }, {"my vocab", "0xff", "256 bytes"});
  v.tokens.emplace_back(std::string(1, char(255)), 255);
  v.merges = {{"a", "q"}};
  expect_error([&] { Tokenizer::from_vocab(v); }, {"merge #0", "aq"});
  v.merges.clear();
  v.eos = "</s>";
  expect_error([&] { Tokenizer::from_vocab(v); }, {"EOS token </s>"});
  v.eos.clear();
  v.specials = {{"<a>", 256}, {"<a>", 257}};
  expect_error([&] { Tokenizer::from_vocab(v); }, {"<a>", "twice"});
  expect_error([] { gpt2().decode({15496, -1}); }, {"token id -1"});
  expect_error([] { gpt2().token_bytes(50257); }, {"token id 50257", "vocab_size 50257"});
}

}  // namespace
}  // namespace k3

// ---- other families' formats, exact against tokenizers and tiktoken ----

namespace k3 {
namespace {

const std::string kFormats = std::string(K3_SOURCE_DIR) + "/tests/data/tokenizer/";

TEST(TokenizerFormats, EveryFixtureMatchesItsReference) {
  const json texts = json::parse(slurp(kFormats + "multilingual.json"));
  const json goldens = json::parse(slurp(kFormats + "format_goldens.json"));
  std::string joined;
  for (size_t i = 0; i < texts.size(); ++i) joined += (i ? "\n" : "") + texts[i].get<std::string>();
  ASSERT_EQ(goldens["fixtures"].size(), 4u);
  for (const auto& [name, g] : goldens["fixtures"].items()) {
    SCOPED_TRACE(name + " (reference: " + g["reference"].get<std::string>() + ")");
    const Tokenizer tok = Tokenizer::from_dir(kFormats + "formats/" + name);
    std::vector<std::string> all = texts.get<std::vector<std::string>>();
    if (g.contains("extra_texts"))
      for (const auto& t : g["extra_texts"]) all.push_back(t.get<std::string>());
    ASSERT_EQ(g["texts"].size(), all.size());
    int mismatches = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      const std::vector<int32_t> got = tok.encode(all[i]);
      const auto want = g["texts"][i].get<std::vector<int32_t>>();
      if (got != want && ++mismatches <= 3) {
        ADD_FAILURE() << "text " << i << " \"" << all[i].substr(0, 60) << "\": " << json(got).dump().substr(0, 200)
                      << " vs " << json(want).dump().substr(0, 200);
      }
      // Decoding gives the text back where nothing normalizes it, and re-encodes to the same ids
      // where nothing is removed (pipeline-mix drops spaces).
      const std::string back = tok.decode(got);
      if (name == "deepseek-v3" || name == "kimi") {
        EXPECT_EQ(back, all[i]) << i;
      }
      if (name != "pipeline-mix") {
        EXPECT_EQ(tok.encode(back), got) << i;
      }
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(tok.encode(joined), g["joined"].get<std::vector<int32_t>>());
  }
}

TEST(TokenizerFormats, KimiFolderReadsSpecialsAndReservedIds) {
  const Tokenizer tok = Tokenizer::from_dir(kFormats + "formats/kimi");
  const int32_t base = *tok.special_id("[BOS]");
  EXPECT_EQ(tok.special_id("[EOS]"), base + 1);
  EXPECT_EQ(tok.special_id("[PAD]"), base + 255);
  EXPECT_EQ(tok.special_id("<|reserved_token_" + std::to_string(base + 5) + "|>"), base + 5);
  EXPECT_EQ(tok.vocab_size(), base + 256);
  EXPECT_EQ(tok.eos_id(), base + 1);  // tokenizer_config.json's eos_token
}

TEST(TokenizerFormats, SavedTokenizerJsonKeepsThePipeline) {
  TempDir dir;
  for (const char* name : {"qwen3", "pipeline-mix"}) {
    const Tokenizer tok = Tokenizer::from_dir(kFormats + "formats/" + name);
    tok.save_hf_tokenizer_json(dir.file("tokenizer.json"));
    const Tokenizer back = Tokenizer::from_hf_tokenizer_json(dir.file("tokenizer.json"));
    for (const char* text : {"Café naïve 123-456 ＡＢＣ", "北京 東京 서울 -- it's OK"})
      EXPECT_EQ(back.encode(text), tok.encode(text)) << name << ": " << text;
  }
}

TEST(TokenizerFormats, ABacktrackingPatternFailsInsteadOfHanging) {
  const tok::Regex re("(a+)+b");  // exponential on a run of a's with no b
  std::vector<std::pair<size_t, size_t>> spans;
  try {
    re.find_all(std::string(40, 'a'), spans);
    ADD_FAILURE() << "matched";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("backtracks"), std::string::npos) << e.what();
  }
  // Long runs under the families' patterns are no such case.
  const tok::Regex kimi(tok::kKimiPattern);
  spans.clear();
  kimi.find_all(std::string(1 << 20, ' ') + "x" + std::string(1 << 20, 'a'), spans);
  EXPECT_EQ(spans.size(), 2u);  // the spaces but the last; " xaaa..."
}

TEST(TokenizerFormats, TiktokenFileErrorsNameTheLine) {
  TempDir dir;
  spit(dir.file("bad.tiktoken"), "IQ== 0\nnot-base64! 1\n");
  try {
    Tokenizer::from_tiktoken_file(dir.file("bad.tiktoken"), "\\S+", {});
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.tiktoken:2"), std::string::npos) << e.what();
  }
  fs::create_directories(dir.path() / "folder");
  spit(dir.path() / "folder" / "tiktoken.model", "IQ== 0\n");
  try {
    Tokenizer::from_dir(dir.file("folder"));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pat_str"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3
