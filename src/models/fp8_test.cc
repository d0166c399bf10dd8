// Block-scaled FP8 weights (F8_E4M3 with a float weight_scale_inv per 128 x 128 block, as
// DeepSeek-V3 and Kimi ship them): deepseek-v3-tiny with every projection quantized by torch
// (tools/make_fp8_goldens.py) loads, and its logits equal transformers' on the weights torch
// dequantized. A missing or misshapen scale is refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <cstring>
#include <set>
#include <fstream>
#include <unistd.h>

#include "io/safetensors.h"
#include "models/registry.h"
#include "models/testing.h"

namespace k3 {

namespace fs = std::filesystem;

namespace {
std::string fp8_checkpoint() { return std::string(K3_SOURCE_DIR) + "/tests/data/fp8/deepseek-v3-tiny-fp8"; }

// The golden checkpoint with `edit` applied to its tensors, in a temporary folder.
std::string edited(const std::string& tag, const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  const fs::path dir = fs::temp_directory_path() / ("k3_fp8_" + tag + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(fp8_checkpoint() + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  const SafeTensors st = SafeTensors::open(fp8_checkpoint() + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& n : st.names()) ts.push_back({n, st.get(n)});
  edit(ts);
  save_safetensors((dir / "model.safetensors").string(), ts);
  return dir.string();
}
// The model's logits on the golden's ids against transformers' on the weights torch dequantized.
void expect_golden_logits(const Model& model) {
  const SafeTensors expected = SafeTensors::open(fp8_checkpoint() + "/expected.safetensors");
  const Tensor ids = expected.get("input_ids"), ref = expected.get_f32("logits");
  const int64_t B = ids.dim(0), T = ids.dim(1), V = model.vocab_size();
  std::vector<float> out(static_cast<size_t>(B * T * V));
  model.logits(TokenBatch{ids.data<int64_t>(), B, T, nullptr}, out.data(), Logits::All);
  EXPECT_LT(testing::rel_l2(out.data(), ref.f32(), B * T * V), 1e-4);
}
}  // namespace

TEST(Fp8Weights, BlockScaledCheckpointMatchesTransformersOnTheDequantizedWeights) {
  auto model = load_model(fp8_checkpoint());
  expect_golden_logits(*model);
}

TEST(Fp8Weights, AMissingOrMisshapenScaleIsRefusedByName) {
  const std::string w = "model.layers.0.mlp.gate_proj.weight";
  const std::string no_scale = edited("noscale", [&](auto& ts) {
    std::erase_if(ts, [&](const auto& t) { return t.first == w + "_scale_inv"; });
  });
  try {
    load_model(no_scale);
    ADD_FAILURE() << "an FP8 weight without its scale loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no '" + w + "_scale_inv'"), std::string::npos) << e.what();
  }
  const std::string bad_shape = edited("shape", [&](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == w + "_scale_inv") t = Tensor::full({1, 1, 1}, 1.0f);
  });
  try {
    load_model(bad_shape);
    ADD_FAILURE() << "a misshapen FP8 scale loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("in blocks of 128 x 128 needs"), std::string::npos) << e.what();
  }
  fs::remove_all(fs::path(no_scale));
  fs::remove_all(fs::path(bad_shape));
}

}  // namespace k3

namespace k3 {

// Kept packed (PackedWeights::Keep, as inference loads it; weights whose rows are not whole blocks
// of 128 are inflated), the same checkpoint gives the same logits through the linear layer's FP8
// product, and writing it back reproduces torch's codes and scales bit for bit.
TEST(Fp8Weights, KeptPackedMatchesAndWritesBackTheSameTensors) {
  auto model = load_model(fp8_checkpoint(), LoadPlan::packed_on_host());
  std::set<std::string> packed_names;  // those whose rows are whole blocks of 128 (others are inflated)
  model->visit([&](const std::string& name, Node& p, ParamKind) {
    if (p.value.dtype() == DType::F8B128) packed_names.insert(model->checkpoint_name(name));
  });
  const int64_t packed = int64_t(packed_names.size());
  EXPECT_GT(packed, 0);
  expect_golden_logits(*model);

  const fs::path dir = fs::temp_directory_path() / ("k3_fp8_roundtrip_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  save_model(*model, dir.string());
  const SafeTensors orig = SafeTensors::open(fp8_checkpoint() + "/model.safetensors");
  const SafeTensors back = SafeTensors::open((dir / "model.safetensors").string());
  int64_t compared = 0;
  for (const auto& n : orig.names()) {
    const Tensor a = orig.get(n);
    const std::string weight = n.ends_with("_scale_inv") ? n.substr(0, n.size() - 10) : n;
    if (!packed_names.count(weight)) continue;
    ASSERT_TRUE(back.has(n)) << n;
    const Tensor b = back.get(n);
    ASSERT_EQ(b.shape(), a.shape()) << n;
    ASSERT_EQ(b.dtype(), a.dtype()) << n;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << n;
    ++compared;
  }
  EXPECT_GE(compared, 2 * packed);
  fs::remove_all(dir);
}

}  // namespace k3

namespace k3 {

TEST(Fp8Weights, ANaNCodeIsRefusedByNameWhenKeptPacked) {
  const std::string w = "model.layers.0.mlp.gate_proj.weight";
  const std::string dir = edited("nan", [&](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == w) {
        t = t.clone();
        t.template data<uint8_t>()[5] = 0xff;  // S.1111.111
      }
  });
  try {
    load_model(dir, LoadPlan::packed_on_host());
    ADD_FAILURE() << "an FP8 NaN code loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + w + "' holds a NaN"), std::string::npos) << e.what();
  }
  fs::remove_all(fs::path(dir));
}

}  // namespace k3
