// Models with their linear layers quantised on load (move_to with WeightStorage::quantize): each
// fixture model's logits through the packed FP8 and MXFP4 products equal those of the same model
// whose weights were rounded through the format and inflated back to fp32 (so the kernels, not
// the rounding, are what is compared), and differ from the unquantised model's; the experts-only
// form touches only routed experts; a quantised model written by save_model loads back packed
// with the same bytes and inflated with the same values; GPT-2's [in, out] weights are refused.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <unistd.h>

#include "models/registry.h"
#include "models/testing.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

std::vector<float> logits_of(const Model& m, const std::vector<int64_t>& ids) {
  std::vector<float> out(ids.size() * size_t(m.vocab_size()));
  m.logits(TokenBatch{ids.data(), 1, int64_t(ids.size()), nullptr}, out.data(), Logits::All);
  return out;
}

struct Case {
  const char* model;
  DType fmt;
  bool experts_only;
};

class Quantized : public ::testing::TestWithParam<Case> {};

TEST_P(Quantized, PackedProductsMatchTheRoundedWeightsInflated) {
  const Case c = GetParam();
  const std::string dir = testing::fixture_model(c.model);
  auto packed = load_model(dir), rounded = load_model(dir), plain = load_model(dir);
  move_to(*packed, Device::CPU, WeightStorage{.gemm = DType::F32, .quantize = c.fmt, .experts_only = c.experts_only});
  // The reference: each weight packed holds, rounded through the format on its own and inflated.
  std::map<std::string, DType> held;
  int64_t n_packed = 0;
  packed->visit([&](const std::string& name, Node& p, ParamKind) {
    held[name] = p.value.dtype();
    if (is_block_dtype(p.value.dtype())) {
      ++n_packed;
      if (c.experts_only) {
        EXPECT_NE(name.find(".experts."), std::string::npos) << name;
      }
      EXPECT_EQ(name.find("lm_head"), std::string::npos) << name;
    }
  });
  EXPECT_GT(n_packed, 0);
  rounded->visit([&](const std::string& name, Node& p, ParamKind) {
    if (is_block_dtype(held.at(name))) p.value = p.value.to(held.at(name)).to(DType::F32);
  });
  const std::vector<int64_t> ids = {1, 5, 9, 2, 7, 3, 11, 4};
  const std::vector<float> a = logits_of(*packed, ids), b = logits_of(*rounded, ids), o = logits_of(*plain, ids);
  EXPECT_LT(testing::rel_l2(a.data(), b.data(), int64_t(a.size())), 2e-5);
  EXPECT_GT(testing::rel_l2(a.data(), o.data(), int64_t(a.size())), 1e-3);  // the weights did change
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, Quantized,
    ::testing::Values(Case{"deepseek-v3-tiny", DType::F8B128, false}, Case{"deepseek-v3-tiny", DType::MXFP4, true},
                      Case{"qwen3-next-tiny", DType::F8B128, false}, Case{"qwen3-next-tiny", DType::MXFP4, false},
                      Case{"kimi-linear-tiny", DType::MXFP4, false}, Case{"kimi-k3-tiny", DType::F8B128, false},
                      Case{"kimi-k3-tiny", DType::MXFP4, true}),
    [](const auto& p) {
      std::string s = std::string(p.param.model) + "_" + std::string(dtype_name(p.param.fmt)) +
                      (p.param.experts_only ? "_experts" : "");
      for (char& ch : s)
        if (ch == '-') ch = '_';
      return s;
    });

TEST(Quantize, WrittenModelsLoadBackPackedAndInflated) {
  for (DType fmt : {DType::F8B128, DType::MXFP4}) {
    auto m = load_model(testing::fixture_model("qwen3-next-tiny"));
    move_to(*m, Device::CPU, WeightStorage{.gemm = DType::F32, .quantize = fmt, .experts_only = false});
    const fs::path dir = fs::temp_directory_path() / ("k3_quantized_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    save_model(*m, dir.string());
    auto kept = load_model(dir.string(), LoadPlan::packed_on_host()), inflated = load_model(dir.string());
    std::map<std::string, Tensor> want;
    m->visit([&](const std::string& name, Node& p, ParamKind) { want[name] = p.value; });
    kept->visit([&](const std::string& name, Node& p, ParamKind) {
      const Tensor& w = want.at(name);
      ASSERT_EQ(p.value.dtype(), w.dtype()) << name;
      EXPECT_EQ(std::memcmp(p.value.raw(), w.raw(), w.nbytes()), 0) << name;
    });
    inflated->visit([&](const std::string& name, Node& p, ParamKind) {
      ASSERT_EQ(p.value.dtype(), DType::F32) << name;
      const Tensor w = want.at(name).to(DType::F32);
      for (int64_t i = 0; i < w.numel(); ++i) ASSERT_EQ(p.value.f32()[i], w.f32()[i]) << name << " " << i;
    });
    fs::remove_all(dir);
  }
}

// A placing load (each weight quantised and placed as it is read) gives the weights a load and then
// move_to give, bit for bit.
TEST(Quantize, APlacingLoadHoldsWhatMoveToMakes) {
  const WeightStorage s{.gemm = DType::F32, .quantize = DType::MXFP4, .experts_only = true};
  const std::string dir = testing::fixture_model("kimi-k3-tiny");
  auto placed = load_model(dir, LoadPlan::inference(Device::CPU, s)), moved = load_model(dir);
  move_to(*moved, Device::CPU, s);
  std::map<std::string, Tensor> want;
  moved->visit([&](const std::string& name, Node& p, ParamKind) { want[name] = p.value; });
  int64_t packed = 0;
  placed->visit([&](const std::string& name, Node& p, ParamKind) {
    const Tensor& w = want.at(name);
    ASSERT_EQ(p.value.dtype(), w.dtype()) << name;
    ASSERT_EQ(p.value.shape(), w.shape()) << name;
    packed += is_block_dtype(w.dtype());
    EXPECT_EQ(std::memcmp(p.value.raw(), w.raw(), w.nbytes()), 0) << name;
  });
  EXPECT_GT(packed, 0);
}

TEST(Quantize, Gpt2IsRefusedByName) {
  auto m = load_model(testing::fixture_model("gpt2-tiny"));
  try {
    move_to(*m, Device::CPU, WeightStorage{.gemm = DType::F32, .quantize = DType::F8B128, .experts_only = false});
    ADD_FAILURE() << "GPT-2 was quantised";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[in, out]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3
