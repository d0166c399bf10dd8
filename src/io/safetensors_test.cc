#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

namespace k3 {
namespace fs = std::filesystem;

namespace {
fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() / ("k3_io_test_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

// Builds a raw safetensors byte string from a header and data, for malformed-file tests.
std::vector<char> raw_file(const std::string& header, size_t data_bytes, uint64_t claimed_len = UINT64_MAX) {
  uint64_t n = claimed_len == UINT64_MAX ? header.size() : claimed_len;
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(char((n >> (8 * i)) & 0xff));
  s += header;
  s.append(data_bytes, '\0');
  return std::vector<char>(s.begin(), s.end());
}

std::string error_of(const std::vector<char>& bytes) {
  try {
    SafeTensors::from_buffer(std::make_shared<std::vector<char>>(bytes), "mem.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(SafeTensors, ReadsTheGpt2FixtureZeroCopy) {
  SafeTensors s = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/models/gpt2-tiny/model.safetensors");
  EXPECT_TRUE(s.has("transformer.wte.weight"));
  Tensor w = s.get("transformer.wte.weight");
  EXPECT_EQ(w.shape(), (Shape{512, 64}));
  EXPECT_EQ(w.dtype(), DType::F32);
  EXPECT_EQ(s.metadata().at("format"), "pt");
}

TEST(SafeTensors, WritesAndReadsEveryDtype) {
  fs::path d = temp_dir();
  std::vector<std::pair<std::string, Tensor>> ts;
  Tensor f = Tensor::from_vector({1.5f, -2.0f, 0.25f, 7.0f, 0, 1}, {2, 3});
  ts.push_back({"f32", f});
  ts.push_back({"bf16", f.to(DType::BF16)});
  ts.push_back({"f16", f.to(DType::F16)});
  Tensor i64 = Tensor::empty({3}, DType::I64);
  for (int i = 0; i < 3; ++i) i64.data<int64_t>()[i] = int64_t(1) << (40 + i);
  ts.push_back({"i64", i64});
  Tensor u8 = Tensor::empty({5}, DType::U8);
  for (int i = 0; i < 5; ++i) u8.data<uint8_t>()[i] = uint8_t(250 + i);
  ts.push_back({"u8", u8});
  Tensor f8 = Tensor::empty({2}, DType::F8E4M3);
  f8.data<uint8_t>()[0] = 0x38;
  f8.data<uint8_t>()[1] = 0xc0;  // -2
  ts.push_back({"f8", f8});
  ts.push_back({"strided", f.slice(1, 1, 3)});
  save_safetensors((d / "a.safetensors").string(), ts, {{"k", "v"}});
  SafeTensors s = SafeTensors::open((d / "a.safetensors").string());
  EXPECT_EQ(s.metadata().at("k"), "v");
  for (const char* n : {"f32", "bf16", "f16"}) {
    Tensor g = s.get_f32(n);
    for (int i = 0; i < 6; ++i) EXPECT_EQ(g.f32()[i], f.f32()[i]) << n;
  }
  EXPECT_EQ(s.get("i64").data<int64_t>()[2], int64_t(1) << 42);
  EXPECT_EQ(s.get("u8").data<uint8_t>()[4], 254);
  EXPECT_EQ(s.get_f32("f8").f32()[1], -2.0f);
  Tensor st = s.get_f32("strided");
  EXPECT_EQ(st.shape(), (Shape{2, 2}));
  EXPECT_EQ(st.f32()[2], 0.25f * 0 + 0.0f);  // row 1, col 1 of f = 0
  EXPECT_EQ(st.f32()[1], 0.25f);
  fs::remove_all(d);
}

TEST(SafeTensors, ReadsShardedCheckpoints) {
  fs::path d = temp_dir() / "sharded";
  fs::create_directories(d);
  save_safetensors((d / "model-00001-of-00002.safetensors").string(), {{"a", Tensor::full({2}, 1.0f)}});
  save_safetensors((d / "model-00002-of-00002.safetensors").string(), {{"b", Tensor::full({3}, 2.0f)}});
  std::ofstream(d / "model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})";
  Checkpoint c = Checkpoint::open(d.string());
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.get_f32("b").f32()[2], 2.0f);
  EXPECT_THROW(c.get("c"), Error);
  std::ofstream(d / "model.safetensors.index.json") << R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})";
  EXPECT_THROW(Checkpoint::open(d.string()), Error);
  fs::remove_all(d);
}

TEST(SafeTensors, RejectsMalformedFilesWithClearErrors) {
  auto ok = raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_EQ(error_of(ok), "");
  EXPECT_NE(error_of(std::vector<char>(ok.begin(), ok.begin() + 5)).find("too short"), std::string::npos);
  EXPECT_NE(error_of(std::vector<char>(ok.begin(), ok.end() - 4)).find("past the"), std::string::npos);  // truncated data
  EXPECT_NE(error_of(raw_file("{}", 0, 1000)).find("header length"), std::string::npos);
  EXPECT_NE(error_of(raw_file("{}", 0, uint64_t(1) << 62)).find("header length"), std::string::npos);
  EXPECT_NE(error_of(raw_file("{not json", 0)).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8)).find("unknown dtype"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)).find("needs 12 bytes"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)).find("begin > end"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)).find("overlap"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)).find("non-negative"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8)).find("shape"), std::string::npos);
  EXPECT_NE(error_of(raw_file(R"([1,2])", 0)).find("not a JSON object"), std::string::npos);
  EXPECT_THROW(SafeTensors::open("/nonexistent/model.safetensors"), Error);
}

}  // namespace k3
