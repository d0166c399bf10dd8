#include "io/config.h"

#include <gtest/gtest.h>

namespace k3 {

struct DemoConfig {
  int64_t width = 8;
  double eps = 1e-5;
  std::string act = "gelu";
  std::vector<int64_t> layers;
  std::optional<int64_t> rank;
  template <class V>
  void fields(V& v) {
    v("width", width, Presence::Required).positive();
    v("eps", eps).positive();
    v("act", act).one_of({"gelu", "silu"});
    v("layers", layers).positive();
    v("rank", rank).positive();
  }
};

TEST(Config, ReadsDefaultsAndValidates) {
  auto c = read_config<DemoConfig>(Json::parse(R"({"width": 16, "layers": [1, 4], "rank": null})"), "demo.json");
  EXPECT_EQ(c.width, 16);
  EXPECT_EQ(c.eps, 1e-5);
  EXPECT_EQ(c.layers, (std::vector<int64_t>{1, 4}));
  EXPECT_FALSE(c.rank.has_value());
  auto msg = [](const char* text) {
    try {
      read_config<DemoConfig>(Json::parse(text), "demo.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg(R"({})").find("missing required field 'width'"), std::string::npos);
  EXPECT_NE(msg(R"({"width": -1})").find("'width' = -1 must be > 0"), std::string::npos);
  EXPECT_NE(msg(R"({"width": "big"})").find("should be an integer"), std::string::npos);
  EXPECT_NE(msg(R"({"width": 2, "act": "relu"})").find("not supported"), std::string::npos);
  EXPECT_NE(msg(R"({"width": 2, "layers": [0]})").find("entry 0"), std::string::npos);
  EXPECT_NE(msg(R"({"width": 2, "rank": 1.5})").find("integer or null"), std::string::npos);
}

TEST(Config, WritesWhatItReads) {
  DemoConfig c;
  c.width = 3;
  c.rank = 7;
  Json j = write_config(c);
  auto back = read_config<DemoConfig>(j, "roundtrip");
  EXPECT_EQ(back.width, 3);
  EXPECT_EQ(*back.rank, 7);
  EXPECT_EQ(back.act, "gelu");
}

}  // namespace k3
