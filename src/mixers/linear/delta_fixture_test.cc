// The delta-rule core against flash-linear-attention's naive references (fixtures/ops): outputs,
// final states and every gradient within 1e-4 relative L2, for the recurrent reference and for
// the chunked form at chunk 16, 32, 64 and 128.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "io/safetensors.h"
#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_test_util.h"

namespace k3::linear {
namespace {

using testing::rel_l2;

constexpr double kTol = 1e-4;

struct Case {
  std::string file;
};

std::string fixture_path(const std::string& file) { return std::string(K3_SHARED_DIR) + "/fixtures/ops/" + file; }

class DeltaFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(DeltaFixture, MatchesReference) {
  SafeTensors st = SafeTensors::open(fixture_path(GetParam()));
  const nlohmann::json meta = nlohmann::json::parse(st.metadata().at("fixture"));
  const DeltaOptions base = testing::fixture_options(meta);
  DeltaInputs in;
  in.q = st.get_f32("q");
  in.k = st.get_f32("k");
  in.v = st.get_f32("v");
  if (st.has("beta")) in.beta = st.get_f32("beta");
  if (st.has("g")) in.g = st.get_f32("g");
  if (st.has("h0")) in.h0 = st.get_f32("h0");
  DeltaCotangents cot;
  cot.d_o = st.get_f32("do");
  if (st.has("dht")) cot.dht = st.get_f32("dht");

  struct Run {
    Impl impl;
    int chunk;
  };
  std::vector<Run> runs = {{Impl::Recurrent, 64}, {Impl::Chunked, 16}, {Impl::Chunked, 32},
                           {Impl::Chunked, 64},   {Impl::Chunked, 128}};
  for (const Run& run : runs) {
    DeltaOptions opts = base;
    opts.chunk = run.chunk;
    const std::string label = std::string(run.impl == Impl::Recurrent ? "recurrent" : "chunked") + "/" +
                              std::to_string(run.chunk) + " " + GetParam();
    DeltaOutputs out = delta_forward(in, opts, run.impl);
    std::map<std::string, double> err;
    err["o"] = rel_l2(out.o, st.get_f32("o"));
    if (st.has("ht")) err["ht"] = rel_l2(out.ht, st.get_f32("ht"));
    DeltaGrads g = delta_backward(in, cot, opts, run.impl);
    const std::map<std::string, Tensor*> grads = {{"grad_q", &g.dq},       {"grad_k", &g.dk},
                                                  {"grad_v", &g.dv},       {"grad_beta", &g.dbeta},
                                                  {"grad_g", &g.dg},       {"grad_h0", &g.dh0}};
    for (const auto& [name, t] : grads) {
      if (!st.has(name)) continue;
      ASSERT_TRUE(t->defined()) << label << ": " << name << " not produced";
      err[name] = rel_l2(*t, st.get_f32(name));
    }
    double worst = 0.0;
    std::string line;
    for (const auto& [name, e] : err) {
      EXPECT_LE(e, kTol) << label << ": " << name;
      worst = std::max(worst, e);
      line += " " + name + "=" + std::to_string(e);
    }
    RecordProperty(label, std::to_string(worst));
    if (std::getenv("K3_VERBOSE")) std::printf("%-50s max %.2e |%s\n", label.c_str(), worst, line.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeltaFixture,
                         ::testing::Values("linear_attn.safetensors", "linear_attn_normalized.safetensors",
                                           "delta_rule.safetensors", "gated_delta_rule.safetensors",
                                           "gated_delta_rule_extreme_decay.safetensors",
                                           "kda_logsigmoid.safetensors", "kda_lowerbound.safetensors",
                                           "kda_extreme_decay.safetensors"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           std::string n = param_info.param.substr(0, param_info.param.find('.'));
                           return n;
                         });

}  // namespace
}  // namespace k3::linear
