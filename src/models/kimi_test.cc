// The parameter report of `k3 info` (analytic, from the config) agrees with the modules k3
// builds (storage-less), and with the published figures of spec §11.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "models/registry.h"
#include "models/testing.h"

namespace k3 {

TEST(KimiReport, PublishedK3MatchesTheSpec) {
  ArchReport r = report_config(preset_config("kimi-k3"), "kimi-k3");
  EXPECT_EQ(r.total_params, 2779484476000);  // spec §11
  EXPECT_NEAR(double(r.active_params), 104.2e9, 0.01 * 104.2e9);
  double latent = 0, state = 0;
  for (const auto& lm : r.memory) {
    if (lm.spec.kind == MemoryKind::LatentCache) latent += lm.spec.per_token_bytes;
    if (lm.spec.kind == MemoryKind::RecurrentState) state += lm.spec.fixed_bytes;
  }
  EXPECT_EQ(latent, 27648.0);                      // bf16 latent cache, B/token
  EXPECT_EQ(state, 414.0 * 1024 * 1024);           // fp32 KDA state, B/sequence
  ArchReport seed = report_config(preset_config("kimi-k3-seed"), "kimi-k3-seed");
  EXPECT_EQ(seed.layers, 92);
  EXPECT_NEAR(double(seed.total_params), 2.749e12, 0.001e12);
}

TEST(KimiReport, AnalyticCountEqualsTheBuiltModules) {
  for (const char* p : {"kimi-linear-small", "k3-small", "kimi-k3"}) {
    Json c = preset_config(p);
    auto m = build_model(c, p);  // storage-less: nothing allocated even for 2.8T parameters
    ArchReport r = report_config(c, p);
    EXPECT_EQ(m->total_params(), r.total_params) << p;
    EXPECT_EQ(m->active_params(), r.active_params) << p;
  }
}

// The routed experts a decode step leaves unread, expected under uniform routing (what `bench
// decode`'s roofline takes off the weights): E − k experts' worth per MoE layer for one token,
// all E for none, E·(1 − k/E)^n for n. kimi-k3's published shape: 896 experts, top 16, 92 MoE
// layers (the first of 93 is dense), experts of 3 · 3584 · 3072 parameters in the latent (spec §11).
TEST(KimiReport, IdleExpertsOfADecodeStep) {
  auto m = build_model(preset_config("kimi-k3"), "kimi-k3");
  const double expert = 3.0 * 3584 * 3072, layers = 92, E = 896, k = 16;
  EXPECT_NEAR(m->idle_expert_params(0), layers * E * expert, 1e-9 * layers * E * expert);
  EXPECT_NEAR(m->idle_expert_params(1), layers * (E - k) * expert, 1e-9 * layers * E * expert);
  EXPECT_NEAR(m->idle_expert_params(64), layers * E * std::pow(1 - k / E, 64) * expert, 1e-9 * layers * E * expert);
  EXPECT_EQ(build_model(preset_config("gpt2-tiny"), "gpt2-tiny")->idle_expert_params(8), 0.0);
}

TEST(KimiReport, FixtureModelCountsMatchTheirCheckpoints) {
  auto m = load_model(testing::fixture_model("kimi-linear-tiny"));
  ArchReport r = report_config(read_json_file(testing::fixture_model("kimi-linear-tiny") + "/config.json"), "kimi-linear-tiny");
  EXPECT_EQ(m->total_params(), r.total_params);
}

}  // namespace k3

namespace k3 {

// K3's routed experts as published: MXFP4-packed. The kimi-k3-tiny experts are quantised here
// (round to the nearest E2M1 value under a per-32 power-of-two scale), written packed, loaded,
// and compared with the same model loaded from the dequantised values stored as float32.
TEST(KimiK3, LoadsMxfp4PackedExperts) {
  namespace fs = std::filesystem;
  const std::string src = testing::fixture_model("kimi-k3-tiny");
  const fs::path dir = fs::temp_directory_path() / ("k3_mxfp4_" + std::to_string(::getpid()));
  fs::create_directories(dir / "packed");
  fs::create_directories(dir / "plain");
  Checkpoint ck = Checkpoint::open(src);
  std::vector<std::pair<std::string, Tensor>> packed_ts, plain_ts;
  const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  int quantised = 0;
  for (const auto& name : ck.names()) {
    Tensor t = ck.get_f32(name);
    if (name.find(".experts.") == std::string::npos || t.ndim() != 2 || t.dim(1) % 32 != 0) {
      packed_ts.push_back({name, t});
      plain_ts.push_back({name, t});
      continue;
    }
    const int64_t R = t.dim(0), C = t.dim(1);
    Tensor p = Tensor::zeros({R, C / 2}, DType::U8), s = Tensor::empty({R, C / 32}, DType::U8), deq = Tensor::empty({R, C});
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < C / 32; ++g) {
        float amax = 0;
        for (int64_t c = g * 32; c < g * 32 + 32; ++c) amax = std::max(amax, std::fabs(t.f32()[r * C + c]));
        const int e = amax > 0 ? int(std::ceil(std::log2(amax / 6.0f))) : 0;
        s.data<uint8_t>()[r * (C / 32) + g] = uint8_t(e + 127);
        const float scale = std::ldexp(1.0f, e);
        for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
          const float v = t.f32()[r * C + c] / scale;
          int best = 0;
          for (int k = 1; k < 8; ++k)
            if (std::fabs(std::fabs(v) - grid[k]) < std::fabs(std::fabs(v) - grid[best])) best = k;
          const uint8_t code = uint8_t(best | (v < 0 ? 8 : 0));
          p.data<uint8_t>()[r * (C / 2) + c / 2] |= uint8_t(c % 2 ? code << 4 : code);
          deq.f32()[r * C + c] = (v < 0 ? -grid[best] : grid[best]) * scale;
        }
      }
    const std::string base = name.substr(0, name.size() - std::string("weight").size());
    packed_ts.push_back({base + "weight_packed", p});
    packed_ts.push_back({base + "weight_scale", s});
    plain_ts.push_back({name, deq});
    ++quantised;
  }
  EXPECT_GT(quantised, 0);
  save_safetensors((dir / "packed" / "model.safetensors").string(), packed_ts);
  save_safetensors((dir / "plain" / "model.safetensors").string(), plain_ts);
  fs::copy_file(src + "/config.json", dir / "packed" / "config.json");
  fs::copy_file(src + "/config.json", dir / "plain" / "config.json");
  auto a = load_model((dir / "packed").string()), b = load_model((dir / "plain").string());
  std::vector<int64_t> ids = {5, 17, 42, 7, 300, 12};
  std::vector<float> la(6 * 512), lb(6 * 512);
  a->forward(ids.data(), 6, nullptr, la.data(), Logits::All);
  b->forward(ids.data(), 6, nullptr, lb.data(), Logits::All);
  EXPECT_EQ(la, lb);
  fs::remove_all(dir);
}

}  // namespace k3
