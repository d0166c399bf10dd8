// The harness of `k3 bench memory`: what one sequence's memory costs, mechanism by mechanism, at context 1K..1M:
// the family's central picture. Bytes are measured from the allocated Memory objects (filled
// with zero tokens up to the context), not computed from formulas; past a size budget the
// growth (exactly linear) is extrapolated from the largest measured context and marked "*".
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench/harness/memory.h"
#include "core/format.h"
#include "mixers/linear/delta_layer.h"
#include "mixers/mla/mla.h"
#include "models/registry.h"
#include "train/plot.h"

namespace k3::bench {

namespace {

struct Row {
  std::string name, note;
  std::vector<double> bytes;     // per context
  std::vector<bool> measured;    // false: extrapolated
  double fixed = 0, per_token = 0;  // fitted from the measurements
};

const std::vector<int64_t> kContexts = {1 << 10, 8 << 10, 64 << 10, 128 << 10, 1 << 20};

size_t context_bytes(const Context& c) { return c.bytes(); }

// Measures a model's per-sequence memory by allocation at each context within `budget` bytes.
Row measure_model(const std::string& preset, double budget) {
  // Lift the position limit so the memory can be measured at long contexts: parameters stay
  // storage-less (nothing is allocated for them), only the memories are.
  Json cfg = preset_config(preset);
  Json& inner = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  inner[inner.contains("n_positions") ? "n_positions" : "max_position_embeddings"] = int64_t(1) << 21;
  auto model = build_model(cfg, preset);
  Row r;
  r.name = preset;
  double per_token_spec = 0;
  for (const auto& lm : model->memory_layers()) per_token_spec += lm.spec.per_token_bytes;
  int64_t last = 0;
  double last_bytes = 0;
  Context base = model->new_context(1 << 20);
  const double b0 = double(context_bytes(base));
  for (int64_t c : kContexts) {
    if (per_token_spec * double(c) + b0 <= budget && c <= model->max_positions()) {
      Context cx = model->new_context(c);
      for (auto& m : cx.layers) m->extend_zeros(c);
      last_bytes = double(context_bytes(cx));
      last = c;
      r.bytes.push_back(last_bytes);
      r.measured.push_back(true);
    } else {
      r.bytes.push_back(-1);
      r.measured.push_back(false);
    }
  }
  r.fixed = b0;
  r.per_token = last > 0 ? (last_bytes - b0) / double(last) : per_token_spec;
  for (size_t i = 0; i < kContexts.size(); ++i)
    if (!r.measured[i]) r.bytes[i] = r.fixed + r.per_token * double(kContexts[i]);
  if (model->max_positions() < kContexts.back())
    r.note = "past " + std::to_string(model->max_positions()) + " positions the model itself stops";
  return r;
}

// Kimi K3 as published (spec §11): one KDA layer's state and one MLA layer's latent cache are
// allocated and measured, then multiplied by the layer counts (69 KDA, 24 MLA).
Row measure_kimi_k3() {
  auto kda = DeltaLayer(DeltaLayerOptions::kimi_k3_kda(7168, 96, 128, 1e-5f));
  auto state = kda.new_memory(1);
  const double kda_bytes = double(state->bytes());
  double s_bytes = 0, tail_bytes = 0;
  for (const auto& spec : kda.memory_spec()) (spec.kind == MemoryKind::RecurrentState ? s_bytes : tail_bytes) += spec.fixed_bytes;
  MlaOptions mo;
  mo.d_model = 7168;
  mo.heads = 96;
  mo.q_lora_rank = 1536;
  mo.kv_lora_rank = 512;
  mo.qk_nope_head_dim = 128;
  mo.qk_rope_head_dim = 64;
  mo.v_head_dim = 128;
  Mla mla(mo);
  auto cache = mla.new_memory(8192);
  cache->extend_zeros(8192);
  // k3 keeps the latent cache in fp32; the published serving layout is bf16: half of it.
  const double latent_bf16_per_token = double(cache->bytes()) / 8192.0 / 2.0;
  Row r;
  r.name = "kimi-k3 (published)";
  r.fixed = 69 * kda_bytes;
  r.per_token = 24 * latent_bf16_per_token;
  r.note = "69 KDA states (fp32, measured on one layer) + 24 MLA latent caches (bf16 layout; k3 holds fp32)";
  for (int64_t c : kContexts) {
    r.bytes.push_back(r.fixed + r.per_token * double(c));
    r.measured.push_back(false);
  }
  std::printf("kimi-k3: one KDA layer allocates %s (state %s + conv tails %s); x69 = %s, of which the fp32 state is "
              "%s (spec §11: 414 MiB)\n",
              human_bytes(kda_bytes).c_str(), human_bytes(s_bytes).c_str(), human_bytes(tail_bytes).c_str(),
              human_bytes(r.fixed).c_str(), human_bytes(69 * s_bytes).c_str());
  std::printf("kimi-k3: one MLA layer's latent cache allocates %.0f B/token in fp32 = %.0f B/token in bf16; x24 = %.0f "
              "B/token (spec §11: 27,648)\n",
              2 * latent_bf16_per_token, latent_bf16_per_token, r.per_token);
  return r;
}

}  // namespace

void run_memory_bench(const MemoryBenchOptions& o) {
  const std::vector<std::string> presets = {"gpt2-small",   "linear-small",      "deltanet-small", "gdn-small",
                                            "kda-small",    "kimi-linear-small", "k3-small",       "k3-small-attn"};
  std::vector<Row> rows;
  for (const auto& p : presets) rows.push_back(measure_model(p, o.budget_gib * double(1 << 30)));
  rows.push_back(measure_kimi_k3());
  std::printf("\nbytes of memory for one sequence (measured by allocation; * = linear extrapolation)\n");
  std::printf("%-22s", "mechanism");
  for (int64_t c : kContexts) std::printf(" %12s", context_label(c).c_str());
  std::printf("   %s\n", "growth");
  for (const auto& r : rows) {
    std::printf("%-22s", r.name.c_str());
    for (size_t i = 0; i < kContexts.size(); ++i)
      std::printf(" %11s%s", human_bytes(r.bytes[i]).c_str(), r.measured[i] ? " " : "*");
    std::printf("   %s/token + %s\n", human_bytes(r.per_token).c_str(), human_bytes(r.fixed).c_str());
  }
  // Crossovers against softmax attention of the same width (gpt2-small).
  const Row& kv = rows[0];
  std::printf("\ncrossover with %s's KV cache (context where the KV cache outgrows the mechanism's memory)\n",
              kv.name.c_str());
  for (size_t i = 1; i + 1 < rows.size(); ++i) {
    const Row& r = rows[i];
    if (r.per_token >= kv.per_token) {
      std::printf("  %-20s never (grows as fast or faster)\n", r.name.c_str());
      continue;
    }
    double n = (r.fixed - kv.fixed) / (kv.per_token - r.per_token);
    if (n <= 0)
      std::printf("  %-20s smaller from the first token (%.1fx less per token)\n", r.name.c_str(), kv.per_token / r.per_token);
    else
      std::printf("  %-20s %.0f tokens\n", r.name.c_str(), n);
  }
  const Row& k3 = rows.back();
  std::printf("  kimi-k3 vs an all-MLA kimi-k3 (93 latent caches): %.0f tokens\n",
              k3.fixed / (k3.per_token / 24.0 * 93.0 - k3.per_token));
  // Plot and JSON.
  std::filesystem::create_directories(o.out);
  std::vector<PlotSeries> series;
  Json j = Json::array();
  for (const auto& r : rows) {
    PlotSeries s{r.name, {}, {}, "", true};
    for (size_t i = 0; i < kContexts.size(); ++i) {
      s.x.push_back(double(kContexts[i]));
      s.y.push_back(r.bytes[i] / double(1 << 20));
    }
    series.push_back(s);
    j.push_back({{"name", r.name}, {"contexts", kContexts}, {"bytes", r.bytes}, {"measured", r.measured},
                 {"bytes_per_token", r.per_token}, {"fixed_bytes", r.fixed}, {"note", r.note}});
  }
  write_svg_plot(o.out + "/memory.svg", series,
                 PlotOptions{"memory of one sequence against context", "context (tokens)", "MiB", true, true, 860, 480});
  std::ofstream(o.out + "/memory.json") << j.dump(2) << "\n";
  std::printf("\nwrote %s/memory.svg and %s/memory.json\n", o.out.c_str(), o.out.c_str());
}

}  // namespace k3::bench
