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
