// k3 logits: full forward (no cache) of input_ids [B, T] -> logits [B, T, V].
#include <algorithm>
#include <filesystem>
#include <iostream>

#include "cli/commands.h"
#include "io/safetensors.h"
#include "models/registry.h"

namespace k3::cli {

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Full forward pass: input_ids [B,T] (int64) -> logits [B,T,V] (float32)");
  static std::string model_dir, input, output, dtype = "f32", quantize = "none";
  static RuntimeOptions rt;
  cmd->add_option("--model", model_dir, "Hugging Face model folder")->required();
  cmd->add_option("--input", input, "safetensors file with 'input_ids' int64 [B, T]")->required();
  cmd->add_option("--output", output, "safetensors file to write 'logits' float32 [B, T, V]")->required();
  cmd->add_option("--dtype", dtype, "GEMM weight storage on CUDA: f32, or bf16 (fp32 accumulation; embeddings, norms and routers stay fp32)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  static bool check_weights = false;
  add_check_weights_option(cmd, check_weights);
  add_quantize_option(cmd, quantize);
  add_runtime_options(cmd, rt);
  cmd->callback([] {
    apply_runtime_options(rt, DeviceSupport::CpuAndCuda);
    const WeightStorage storage = weight_storage(dtype, quantize, rt, "logits");
    SafeTensors in = SafeTensors::open(input);
    if (!in.has("input_ids")) throw error("logits", input, ": no tensor named 'input_ids'");
    Tensor ids = in.get("input_ids");
    if (ids.dtype() != DType::I64 && ids.dtype() != DType::I32)
      throw error("logits", input, ": input_ids must be int64 (or int32), got ", ids.describe());
    if (ids.ndim() == 1) ids = ids.reshape({1, ids.dim(0)});
    if (ids.ndim() != 2) throw error("logits", input, ": input_ids must be [B, T], got ", ids.describe());
    if (ids.dim(0) == 0 || ids.dim(1) == 0)
      throw error("logits", input, ": input_ids ", ids.describe(), " holds no tokens (B and T must be at least 1)");
    if (ids.dtype() == DType::I32) {
      Tensor c = Tensor::empty(ids.shape(), DType::I64);
      for (int64_t i = 0; i < ids.numel(); ++i) c.data<int64_t>()[i] = ids.data<int32_t>()[i];
      ids = c;
    }
    auto model = load_model(model_dir, LoadPlan::inference(rt.device == "cuda" ? Device::CUDA : Device::CPU, storage));
    if (check_weights) check_weights_finite(*model);
    const int64_t B = ids.dim(0), T = ids.dim(1), V = model->vocab_size();
    Tensor logits = Tensor::empty({B, T, V});  // [B, T, V]
    // Every architecture runs on CUDA through the ops' device forms (models/model.h).
    for (int64_t b = 0; b < B; ++b)
      model->forward(ids.data<int64_t>() + b * T, T, nullptr, logits.f32() + b * T * V, Logits::All);
    save_safetensors(output, {{"logits", logits}});
  });
}

}  // namespace k3::cli
