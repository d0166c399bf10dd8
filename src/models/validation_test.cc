// Bad values in a config or a checkpoint are refused where they are read, with a message naming
// the field or tensor: positive RoPE/YaRN parameters, routing within the experts, sizes within
// bounds, weight dtypes a weight may have, and (on request) finite weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/registry.h"
#include "models/testing.h"

namespace k3 {

namespace fs = std::filesystem;

namespace {

// The message of the k3::Error that F throws, or "" if it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

Json deepseek_tiny() {
  return Json{{"model_type", "deepseek_v3"}, {"vocab_size", 64},  {"hidden_size", 32},
              {"intermediate_size", 64},     {"moe_intermediate_size", 16}, {"num_hidden_layers", 1},
              {"num_attention_heads", 2},    {"q_lora_rank", 16}, {"kv_lora_rank", 16},
              {"qk_nope_head_dim", 8},       {"qk_rope_head_dim", 8}, {"v_head_dim", 8},
              {"n_routed_experts", 4},       {"num_experts_per_tok", 2}, {"n_group", 1}, {"topk_group", 1},
              {"first_k_dense_replace", 1},  {"max_position_embeddings", 128},
              {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32},
                                {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}}};
}

}  // namespace

TEST(ConfigValidation, RopeAndYarnParametersArePositiveAndTyped) {
  EXPECT_EQ(error_of([] { build_model(deepseek_tiny(), "ds"); }), "");
  auto with = [](const char* key, Json v) {
    Json c = deepseek_tiny();
    c["rope_scaling"][key] = v;
    return error_of([&] { build_model(c, "ds"); });
  };
  EXPECT_NE(with("factor", 0.0).find("'factor'"), std::string::npos);
  EXPECT_NE(with("factor", -2.0).find("must be > 0"), std::string::npos);
  EXPECT_NE(with("factor", "big").find("'factor' should be"), std::string::npos);
  EXPECT_NE(with("original_max_position_embeddings", 0).find("original_max_position_embeddings"), std::string::npos);
  EXPECT_NE(with("rope_theta", -1.0).find("rope_theta"), std::string::npos);
  EXPECT_NE(with("beta_fast", 0.5).find("beta_fast"), std::string::npos);
  Json c = deepseek_tiny();
  c["rope_theta"] = 0.0;
  EXPECT_NE(error_of([&] { build_model(c, "ds"); }).find("rope_theta"), std::string::npos);
  c = deepseek_tiny();
  c["rope_scaling"] = "yarn";
  EXPECT_NE(error_of([&] { build_model(c, "ds"); }).find("rope_scaling"), std::string::npos);
}

TEST(ConfigValidation, InfoChecksWhatLoadingChecks) {
  Json k = preset_config("kimi-linear-tiny");
  Json& t = k.contains("text_config") ? k["text_config"] : k;
  t["num_experts_per_token"] = 100;  // of 8 or so experts
  std::string m = error_of([&] { report_config(k, "k"); });
  EXPECT_NE(m.find("num_experts_per_token"), std::string::npos) << m;
  k = preset_config("kimi-linear-tiny");
  (k.contains("text_config") ? k["text_config"] : k)["intermediate_size"] = 1e12;
  m = error_of([&] { report_config(k, "k"); });
  EXPECT_NE(m.find("intermediate_size"), std::string::npos) << m;
  Json d = deepseek_tiny();
  d["num_experts_per_tok"] = 5;  // of 4
  m = error_of([&] { report_config(d, "d"); });
  EXPECT_NE(m.find("num_experts_per_tok"), std::string::npos) << m;
}

TEST(ConfigValidation, SpecialTokenIds) {
  Json g = preset_config("gpt2-tiny");
  g["eos_token_id"] = -3;
  EXPECT_NE(error_of([&] { build_model(g, "g"); }).find("eos_token_id"), std::string::npos);
  g["eos_token_id"] = 5000;  // past a 1K vocabulary: reported (transformers accepts it)
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(error_of([&] { build_model(g, "g"); }), "");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("eos_token_id 5000 is not a token id"), std::string::npos) << err;
}

class WeightValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("k3_weights_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    auto m = build_model(preset_config("kimi-linear-tiny"), "kimi-linear-tiny");
    m->init_random(3);
    save_model(*m, dir.string());
  }
  void TearDown() override { fs::remove_all(dir); }
  // Rewrites model.safetensors with tensor NAME replaced by what EDIT makes of it.
  template <class F>
  void rewrite(const std::string& name, F edit) {
    std::vector<std::pair<std::string, Tensor>> ts;
    {
      SafeTensors st = SafeTensors::open((dir / "model.safetensors").string());
      for (const auto& n : st.names()) ts.push_back({n, st.get(n).clone()});
    }
    bool found = false;
    for (auto& [n, t] : ts)
      if (n == name) t = edit(t), found = true;
    ASSERT_TRUE(found) << name;
    save_safetensors((dir / "model.safetensors").string(), ts);
  }
  fs::path dir;
};

TEST_F(WeightValidation, IntegerDtypeForAWeightIsRefused) {
  rewrite("lm_head.weight", [](const Tensor& t) { return Tensor::zeros(t.shape(), DType::I32); });
  const std::string m = error_of([&] { load_model(dir.string()); });
  EXPECT_NE(m.find("lm_head.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("I32"), std::string::npos) << m;
}

TEST_F(WeightValidation, NonFiniteWeightsAreFoundOnRequest) {
  auto clean = load_model(dir.string());
  EXPECT_EQ(error_of([&] { check_weights_finite(*clean); }), "");
  rewrite("lm_head.weight", [](const Tensor& t) {
    Tensor c = t.clone();
    c.f32()[7] = std::numeric_limits<float>::quiet_NaN();
    c.f32()[9] = std::numeric_limits<float>::infinity();
    return c;
  });
  auto bad = load_model(dir.string());
  const std::string m = error_of([&] { check_weights_finite(*bad); });
  EXPECT_NE(m.find("'lm_head.weight' (2 of them)"), std::string::npos) << m;
}

// Qwen3-Next: the layer types, the head groupings and the RoPE parameters are checked where read.
TEST(ConfigValidation, Qwen3NextLayerTypesHeadsAndRope) {
  const Json base = read_json_file(testing::fixture_model("qwen3-next-tiny") + "/config.json");
  EXPECT_EQ(error_of([&] { build_model(base, "qn"); }), "");
  auto with = [&](const std::string& key, Json v) {
    Json c = base;
    c[key] = v;
    return error_of([&] { build_model(c, "qn"); });
  };
  EXPECT_NE(with("layer_types", Json::array({"linear_attention", "full_attention"})).find("one type per layer"),
            std::string::npos);
  EXPECT_NE(with("layer_types", Json::array({"linear_attention", "mamba", "linear_attention", "full_attention"}))
                .find("\"mamba\" is not supported"),
            std::string::npos);
  EXPECT_NE(with("num_key_value_heads", 3).find("cannot share 3 key/value heads"), std::string::npos);
  EXPECT_NE(with("linear_num_value_heads", 3).find("value heads are not groups"), std::string::npos);
  EXPECT_NE(with("attention_bias", true).find("attention_bias"), std::string::npos);
  EXPECT_NE(with("rope_parameters", Json{{"rope_type", "yarn"}}).find("default only"), std::string::npos);
  EXPECT_NE(with("rope_parameters", Json{{"partial_rotary_factor", 2.0}}).find("partial_rotary_factor"),
            std::string::npos);
  EXPECT_NE(with("num_experts_per_tok", 9).find("top-9 of 8 experts"), std::string::npos);
  // Without layer_types, every full_attention_interval-th layer is attention (transformers' rule).
  Json c = base;
  c.erase("layer_types");
  c["full_attention_interval"] = 2;
  const auto m = build_model(c, "qn");
  int attention = 0;
  m->visit([&](const std::string& n, Node&, ParamKind) { attention += n.ends_with("self_attn.q_proj.weight"); });
  EXPECT_EQ(attention, 2);
}

}  // namespace k3
