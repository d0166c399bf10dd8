// Stop strings are found across token boundaries and never leak; text that could begin one is
// held back only as long as it could; the end-of-text token is hidden unless asked for.
#include "server/text_stream.h"

#include <gtest/gtest.h>

namespace k3::serve {

namespace {
// Feeds PIECES through a scanner; returns what it let out and whether a stop string was hit.
std::pair<std::string, bool> scan(std::vector<std::string> stops, const std::vector<std::string>& pieces) {
  StopScanner s(std::move(stops));
  std::string out;
  bool hit = false;
  for (const auto& p : pieces) {
    out += s.push(p, hit);
    if (hit) return {out, true};
  }
  return {out + s.flush(), false};
}

Tokenizer gpt2() {
  const std::string d = std::string(K3_SHARED_DIR) + "/data/gpt2";
  return Tokenizer::from_gpt2_files(d + "/encoder.json", d + "/vocab.bpe");
}
}  // namespace

TEST(StopScanner, FindsStopsAcrossPiecesAndNeverLeaksThem) {
  EXPECT_EQ(scan({"END"}, {"abc E", "N", "D tail"}), std::make_pair(std::string("abc "), true));
  EXPECT_EQ(scan({"END"}, {"abc E", "N", "x"}), std::make_pair(std::string("abc ENx"), false));
  EXPECT_EQ(scan({"\n\n", "###"}, {"one\n", "#", "##two"}), std::make_pair(std::string("one\n"), true));
  EXPECT_EQ(scan({}, {"a", "b"}), std::make_pair(std::string("ab"), false));
  // The earliest stop wins when two complete in one piece.
  EXPECT_EQ(scan({"cd", "bc"}, {"abcd"}), std::make_pair(std::string("a"), true));
}

TEST(StopScanner, HoldsBackOnlyAPossiblePrefix) {
  StopScanner s({"STOP"});
  bool hit = false;
  EXPECT_EQ(s.push("hello ST", hit), "hello ");  // "ST" may begin STOP
  EXPECT_EQ(s.push("ART", hit), "START");        // it did not
  EXPECT_FALSE(hit);
  EXPECT_EQ(s.flush(), "");
}

TEST(TextAssembler, DecodesHidesEosAndStops) {
  const Tokenizer tok = gpt2();
  const std::vector<int32_t> ids = tok.encode("Hello world. Goodbye");
  ASSERT_GT(ids.size(), 3u);
  {
    TextAssembler t(&tok, 50256, /*ignore_eos=*/false, {"."});
    std::string out;
    for (int32_t id : ids) out += t.push(id);
    out += t.finish();
    EXPECT_EQ(out, "Hello world");
    EXPECT_TRUE(t.stop_hit);
  }
  {
    TextAssembler t(&tok, 50256, /*ignore_eos=*/false, {});
    std::string out;
    for (int32_t id : ids) out += t.push(id);
    out += t.push(50256);  // <|endoftext|>: hidden
    out += t.finish();
    EXPECT_EQ(out, "Hello world. Goodbye");
  }
  {
    TextAssembler t(&tok, 50256, /*ignore_eos=*/true, {});
    std::string out = t.push(ids[0]) + t.push(50256) + t.finish();
    EXPECT_EQ(out, "Hello<|endoftext|>");
  }
  TextAssembler none(nullptr, std::nullopt, false, {"x"});  // no tokenizer: token ids only, no text
  EXPECT_EQ(none.push(5), "");
  EXPECT_EQ(none.finish(), "");
}

}  // namespace k3::serve

namespace k3::serve {

// Special tokens other than the markers the chat output reads are left out of the text.
TEST(TextAssembler, HidesSpecialTokensButTheMarkers) {
  BpeVocab v;
  for (int i = 0; i < 256; ++i) v.tokens.emplace_back(std::string(1, char(i)), i);
  v.specials = {{"<|im_end|>", 256}, {"<tool_call>", 257}, {"<|eot|>", 258}};
  const Tokenizer tok = Tokenizer::from_vocab(v, "test");
  TextAssembler t(&tok, 258, false, {}, TextAssembler::hidden_specials(tok, {"<tool_call>"}));
  std::string out;
  for (int64_t id : {int64_t('a'), int64_t(256), int64_t(257), int64_t('b'), int64_t(258)}) out += t.push(id);
  out += t.finish();
  EXPECT_EQ(out, "a<tool_call>b");
  TextAssembler shown(&tok, 258, false, {});  // no hidden set: every special but the end token shows
  out.clear();
  for (int64_t id : {int64_t('a'), int64_t(256), int64_t(258)}) out += shown.push(id);
  EXPECT_EQ(out + shown.finish(), "a<|im_end|>");
}

}  // namespace k3::serve
