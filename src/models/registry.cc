#include "models/registry.h"

#include <filesystem>

#include "models/deepseek_v3.h"
#include "models/fla.h"
#include "models/gpt2.h"
#include "models/kimi.h"
#include "models/presets.h"
#include "models/qwen3_next.h"

namespace k3 {

namespace {

struct Architecture {
  const char* model_type;
  std::unique_ptr<Model> (*load)(const std::string& dir, const Json& config, const LoadPlan& plan);  // null: cannot run yet
  std::unique_ptr<Model> (*build)(const Json& config, const std::string& where);  // null: cannot run yet
  ArchReport (*report)(const Json& config, const std::string& name);               // null: count a built model
};

// One line per architecture.
constexpr Architecture kArchitectures[] = {
    {"gpt2", &Gpt2Model::load, &Gpt2Model::from_config, nullptr},
    {"deepseek_v3", &DeepseekV3Model::load, &DeepseekV3Model::from_config, nullptr},
    {"linear_attn", &FlaModel::load, &FlaModel::from_config, nullptr},
    {"delta_net", &FlaModel::load, &FlaModel::from_config, nullptr},
    {"gated_deltanet", &FlaModel::load, &FlaModel::from_config, nullptr},
    {"kda", &FlaModel::load, &FlaModel::from_config, nullptr},
    {"kimi_linear", &KimiModel::load, &KimiModel::linear_from_config, &report_kimi},
    {"kimi_k3", &KimiModel::load, &KimiModel::k3_from_config, &report_kimi},
    {"qwen3_next", &Qwen3NextModel::load, &Qwen3NextModel::from_config, nullptr},
};

const Architecture& find(const Json& config, const std::string& where) {
  if (!config.is_object()) throw error("config", where, ": expected a JSON object");
  if (!config.contains("model_type") || !config["model_type"].is_string())
    throw error("config", where, ": missing 'model_type' (which architecture is this?)");
  std::string t = config["model_type"].get<std::string>();
  std::string known;
  for (const auto& a : kArchitectures) {
    if (t == a.model_type) return a;
    known += std::string(known.empty() ? "" : ", ") + a.model_type;
  }
  throw error("config", where, ": unknown architecture model_type '", t, "' (k3 knows: ", known, ")");
}

}  // namespace

std::unique_ptr<Model> load_model(const std::string& dir, const LoadPlan& plan) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw error("load", dir, ": not a folder (expected a Hugging Face model folder)");
  std::string cfg_path = (fs::path(dir) / "config.json").string();
  Json config = read_json_file(cfg_path);
  const Architecture& a = find(config, cfg_path);
  if (!a.load)
    throw error("load", cfg_path, ": model_type '", a.model_type,
                "' can be described (k3 info) but k3 cannot run it yet");
  return a.load(dir, config, plan);
}

std::unique_ptr<Model> build_model(const Json& config, const std::string& where) {
  const Architecture& a = find(config, where);
  if (!a.build) throw error("config", where, ": model_type '", a.model_type, "' cannot be built by k3 yet");
  return a.build(config, where);
}

ArchReport report_config(const Json& config, const std::string& name) {
  const Architecture& a = find(config, name);
  if (a.report) return a.report(config, name);
  auto m = a.build(config, name);
  return report_from_model(*m, name);
}

std::vector<std::string> preset_names() {
  std::vector<std::string> v;
  for (const auto& p : presets()) v.push_back(p.name);
  return v;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const auto& p : presets()) {
    if (name == p.name) return p;
    known += std::string(known.empty() ? "" : ", ") + p.name;
  }
  throw error("preset", "unknown preset '", name, "' (available: ", known, ")");
}

Json preset_config(const std::string& name) { return find_preset(name).config(); }

Json first_layers(const Json& config, int64_t n, const std::string& where) {
  find(config, where);  // a known architecture
  Json c = config;
  // Kimi K3 keeps its text model's config under text_config.
  Json& t = c.contains("text_config") && c["text_config"].is_object() ? c["text_config"] : c;
  const char* key = t.contains("n_layer") ? "n_layer" : "num_hidden_layers";  // GPT-2 names it n_layer
  if (!t.contains(key) || !t[key].is_number_integer())
    throw error("config", where, ": no integer '", key, "' to cut the layers of");
  const int64_t all = t[key].get<int64_t>();
  if (n < 1 || n > all) throw error("config", where, ": --layers ", n, " is not in [1, ", all, "]");
  t[key] = n;
  // 1-based (Kimi's layer-kind lists) or 0-based (mlp_only_layers) indices past the cut go.
  auto keep_below = [](Json& list, int64_t limit) {
    if (!list.is_array()) return;
    Json kept = Json::array();
    for (const auto& x : list)
      if (!x.is_number_integer() || x.get<int64_t>() < limit) kept.push_back(x);
    list = kept;
  };
  if (t.contains("linear_attn_config") && t["linear_attn_config"].is_object())
    for (const char* k : {"kda_layers", "full_attn_layers"})
      if (t["linear_attn_config"].contains(k)) keep_below(t["linear_attn_config"][k], n + 1);
  if (t.contains("mlp_only_layers")) keep_below(t["mlp_only_layers"], n);
  if (t.contains("layer_types") && t["layer_types"].is_array() && int64_t(t["layer_types"].size()) > n)
    t["layer_types"].erase(t["layer_types"].begin() + n, t["layer_types"].end());
  return c;
}

}  // namespace k3
