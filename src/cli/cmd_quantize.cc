// k3 quantize: a Hugging Face model folder rewritten with its linear layers' weights in a block
// format (FP8 with 128 × 128 block scales as DeepSeek-V3 ships them, or MXFP4 as Kimi K3's experts),
// in the layouts `k3` and those models' checkpoints use, beside a copy of the tokenizer files.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli/commands.h"
#include "core/format.h"
#include "models/registry.h"

namespace k3::cli {

void register_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize",
                                 "Write a model folder with its linear layers' weights in FP8 or MXFP4 (block-scaled)");
  static std::string model_dir, out_dir, format = "fp8";
  static bool check_weights = false;
  cmd->add_option("--model", model_dir, "Hugging Face model folder (config.json + *.safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--format", format,
                  "fp8 (E4M3, one fp32 scale per 128 x 128 tile: '<name>' + '<name>_scale_inv'), mxfp4 (E2M1, one "
                  "E8M0 scale per 32: '<name>_packed' + '<name>_scale'), or fp8-experts / mxfp4-experts for the "
                  "routed experts only. Embeddings, norms, routers, the LM head and MLA's kv_b_proj stay as they are")
      ->check(CLI::IsMember({"fp8", "mxfp4", "fp8-experts", "mxfp4-experts"}))
      ->capture_default_str();
  cmd->add_option("--out", out_dir, "Folder to write (must not hold a model already)")->required();
  add_check_weights_option(cmd, check_weights);
  cmd->callback([] {
    namespace fs = std::filesystem;
    if (fs::exists(fs::path(out_dir) / "model.safetensors") || fs::exists(fs::path(out_dir) / "config.json"))
      throw error("quantize", out_dir, " already holds a model; give an empty or new --out folder");
    if (fs::exists(out_dir) && fs::equivalent(out_dir, model_dir))
      throw error("quantize", "--out is the --model folder; give another");
    WeightStorage storage;
    parse_quantize(format, &storage);
    auto model = load_model(model_dir, LoadPlan::packed_on_host());
    if (check_weights) check_weights_finite(*model);
    const double before = double(model->weight_bytes());
    move_to(*model, Device::CPU, storage);
    int64_t quantised = 0;
    model->visit([&](const std::string&, Node& p, ParamKind) { quantised += is_block_dtype(p.value.dtype()); });
    if (!quantised)
      throw error("quantize", model_dir, ": no weight could be held as ", format,
                  " (block formats hold linear layers' [out, in] weights whose rows are whole blocks)");
    fs::create_directories(out_dir);
    save_model(*model, out_dir);
    // The config says how the weights are stored, as these formats' checkpoints do.
    Json config = read_json_file((fs::path(out_dir) / "config.json").string());
    if (storage.quantize == DType::F8B128)
      config["quantization_config"] = Json{{"quant_method", "fp8"},
                                           {"fmt", "e4m3"},
                                           {"activation_scheme", "dynamic"},
                                           {"weight_block_size", Json::array({128, 128})}};
    else
      config["quantization_config"] = Json{{"quant_method", "compressed-tensors"}, {"format", "mxfp4-pack-quantized"}};
    {
      const std::string tmp = (fs::path(out_dir) / "config.json.tmp").string();
      std::ofstream o(tmp);
      o << config.dump(2) << "\n";
      if (!o) throw error("quantize", "cannot write ", tmp);
      o.close();
      fs::rename(tmp, fs::path(out_dir) / "config.json");
    }
    // Everything else of the folder that is not weights (tokenizer, chat template, generation config).
    for (const auto& e : fs::directory_iterator(model_dir)) {
      const std::string n = e.path().filename().string();
      if (!e.is_regular_file() || n == "config.json" || n.ends_with(".safetensors") || n.ends_with(".safetensors.index.json"))
        continue;
      fs::copy_file(e.path(), fs::path(out_dir) / n, fs::copy_options::overwrite_existing);
    }
    std::printf("wrote %s: %lld weight tensors as %s, weights %s -> %s\n", out_dir.c_str(), (long long)quantised,
                format.c_str(), human_bytes(before).c_str(), human_bytes(double(model->weight_bytes())).c_str());
  });
}

}  // namespace k3::cli
