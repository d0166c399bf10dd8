// k3 info: parameters, weight bytes and per-sequence memory of a model folder or a preset.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>

#include "cli/commands.h"
#include "core/format.h"
#include "models/registry.h"

namespace k3::cli {

namespace {

ArchReport report_for(const std::string& model_dir, const std::string& preset) {
  if (!model_dir.empty()) {
    std::string cfg = (std::filesystem::path(model_dir) / "config.json").string();
    return report_config(read_json_file(cfg), model_dir);
  }
  return report_config(preset_config(preset), preset);
}

void print_report(const ArchReport& r) {
  std::printf("model          %s (%s, %lld layers%s)\n", r.name.c_str(), r.architecture.c_str(), (long long)r.layers,
              r.max_positions ? (", " + std::to_string(r.max_positions) + " positions").c_str() : "");
  for (const auto& n : r.notes) std::printf("               %s\n", n.c_str());
  std::printf("parameters     %s total (%s)\n", with_commas(r.total_params).c_str(), human_count(double(r.total_params)).c_str());
  std::printf("active/token   %s (%s; input embedding lookups excluded)\n", with_commas(r.active_params).c_str(),
              human_count(double(r.active_params)).c_str());
  for (const auto& w : r.weights) std::printf("weights        %s as %s\n", human_bytes(w.bytes).c_str(), w.format.c_str());

  // Per-token and fixed bytes by memory kind.
  struct Agg {
    int64_t layers = 0;
    double per_token = 0, fixed = 0;
  };
  std::map<MemoryKind, Agg> by_kind;
  for (const auto& lm : r.memory) {
    auto& a = by_kind[lm.spec.kind];
    a.layers += 1;
    a.per_token += lm.spec.per_token_bytes;
    a.fixed += lm.spec.fixed_bytes;
  }
  std::printf("\nper-sequence memory by kind\n");
  std::printf("  %-16s %7s %18s %18s\n", "kind", "layers", "bytes/token", "fixed bytes");
  double per_token = 0;
  for (const auto& [kind, a] : by_kind) {
    std::printf("  %-16s %7lld %18s %18s\n", std::string(memory_kind_name(kind)).c_str(), (long long)a.layers,
                with_commas(int64_t(a.per_token)).c_str(), a.fixed ? (with_commas(int64_t(a.fixed)) + " (" + human_bytes(a.fixed) + ")").c_str() : "0");
    per_token += a.per_token;
  }
  std::printf("\nmemory for one sequence at context\n ");
  const int64_t contexts[] = {1 << 10, 8 << 10, 64 << 10, 128 << 10, 1 << 20};
  for (int64_t c : contexts) std::printf(" %12s", context_label(c).c_str());
  std::printf("\n ");
  for (int64_t c : contexts) std::printf(" %12s", human_bytes(r.sequence_bytes(c)).c_str());
  std::printf("\n");
  if (r.max_positions && r.max_positions < contexts[4])
    std::printf("  (contexts past %lld positions are extrapolated: the model itself stops there)\n",
                (long long)r.max_positions);
}

}  // namespace

void register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Parameters, weight bytes and per-sequence memory of a model or preset");
  static std::string model, preset, compare;
  auto* m = cmd->add_option("--model", model, "Hugging Face model folder (config.json)");
  auto* p = cmd->add_option("--preset", preset, "Built-in config: gpt2, kimi-k3, kimi-k3-seed, ...");
  m->excludes(p);
  cmd->add_option("--compare", compare, "Preset to compare sizes against (e.g. gpt2)");
  cmd->callback([] {
    if (model.empty() && preset.empty()) throw error("info", "give --model DIR or --preset NAME");
    ArchReport r = report_for(model, preset);
    print_report(r);
    if (!compare.empty()) {
      ArchReport o = report_config(preset_config(compare), compare);
      std::printf("\nscale vs %s: %.0fx the parameters (%s / %s), %.0fx the active parameters\n", compare.c_str(),
                  double(r.total_params) / double(o.total_params), with_commas(r.total_params).c_str(),
                  with_commas(o.total_params).c_str(), double(r.active_params) / double(o.active_params));
    }
  });
}

}  // namespace k3::cli
