#include <cmath>
#include "models/model.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>

#include "core/device.h"
#include "core/format.h"
#include "core/host_memory.h"
#include "core/parallel.h"
#include "core/profile.h"
#include "core/quant.h"
#include "ops/ag.h"
#include "ops/ag_moe.h"
#include "models/lm_head.h"

namespace k3 {

bool bf16_gemm_weight(const std::string& name, const Tensor& value, ParamKind kind) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  // MoE routers ("mlp.gate.weight" in DeepSeek/Kimi checkpoints) score in fp32 (spec §8.1), and
  // the MLA up-projection feeds the absorbed decode's fp32 products: both stay fp32.
  return kind == ParamKind::Weight && value.ndim() == 2 && !ends_with(".gate.weight") && !ends_with("kv_b_proj.weight");
}

bool block_gemm_weight(const Model& model, const std::string& name, const Tensor& value, ParamKind kind, DType fmt) {
  return model.architecture() != "gpt2" && bf16_gemm_weight(name, value, kind) && !name.ends_with("lm_head.weight") &&
         value.dim(1) % dtype_block(fmt) == 0;
}

bool parse_quantize(const std::string& text, WeightStorage* storage) {
  const bool experts = text.ends_with("-experts");
  const std::string fmt = experts ? text.substr(0, text.size() - 8) : text;
  if (fmt != "fp8" && fmt != "mxfp4") return false;
  storage->quantize = fmt == "fp8" ? DType::F8B128 : DType::MXFP4;
  storage->experts_only = experts;
  return true;
}

namespace {
bool routed_expert(const std::string& name) { return name.find(".experts.") != std::string::npos; }
}  // namespace

void move_to(const Model& model, Device device, DType gemm_weights) { move_to(model, device, WeightStorage{gemm_weights}); }

namespace {
// move_to's and a placing load's checks of the storage asked for.
void check_storage(const Model& model, Device device, const WeightStorage& storage) {
  if (is_block_dtype(storage.quantize) && model.architecture() == "gpt2")
    throw error("model", "GPT-2's linear weights are stored [in, out] (Conv1D); k3's block formats hold [out, in] "
                         "weights, so GPT-2 cannot be quantised");
  if (device == Device::CUDA) device::require_cuda("model");
  if (storage.gemm != DType::F32 && (storage.gemm != DType::BF16 || device != Device::CUDA))
    throw error("model", "GEMM weights can be bf16 on CUDA only (or fp32 anywhere), not ", dtype_name(storage.gemm));
}

// The storage a parameter of this value (a block format kept as it is) gets.
DType storage_of(const Model& model, const std::string& name, const Tensor& value, ParamKind kind,
                 const WeightStorage& storage) {
  if (is_block_dtype(value.dtype())) return value.dtype();
  if (is_block_dtype(storage.quantize) && (!storage.experts_only || routed_expert(name)) &&
      block_gemm_weight(model, name, value, kind, storage.quantize))
    return storage.quantize;
  return storage.gemm == DType::BF16 && bf16_gemm_weight(name, value, kind) ? DType::BF16 : DType::F32;
}

// The parameter's value in its storage on the device.
Tensor placed(const Model& model, const std::string& name, const Tensor& value, ParamKind kind, Device device,
              const WeightStorage& storage) {
  const DType want = storage_of(model, name, value, kind, storage);
  if (value.dtype() == want) return value.to_device(device);
  return value.to_device(Device::CPU).to(want).to_device(device);
}

void check_device_room(double need) {
  const size_t avail = device::available_bytes();
  if (need > double(avail))
    throw error("model", "the weights need ", human_bytes(need), " on the device but ", human_bytes(double(avail)),
                " is free there");
}
}  // namespace

void move_to(const Model& model, Device device, const WeightStorage& storage) {
  check_storage(model, device, storage);
  if (device == Device::CUDA) {  // refused before the first copy, with the bytes needed
    double need = 0;
    model.visit([&](const std::string& name, Node& p, ParamKind kind) {
      if (p.value.device() == Device::CUDA || !p.value.has_storage()) return;
      need += double(dtype_bytes(storage_of(model, name, p.value, kind, storage), p.value.numel()));
    });
    check_device_room(need);
  }
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (!p.value.has_storage()) throw error("model", "parameter '", name, "' has no values to move to the device");
    p.value = placed(model, name, p.value, kind, device, storage);
  });
}

int64_t Model::total_params() const {
  int64_t n = 0;
  visit([&](const std::string&, Node& p, ParamKind) { n += p.value.numel(); });
  return n;
}

int64_t Model::active_params() const {
  int64_t n = 0;
  visit([&](const std::string&, Node& p, ParamKind k) {
    if (k != ParamKind::Embedding) n += p.value.numel();
  });
  return n;
}

size_t Model::weight_bytes() const {
  size_t n = 0;
  visit([&](const std::string&, Node& p, ParamKind) { n += p.value.nbytes(); });
  return n;
}

namespace {
// The rows of h [B*T, D] into the contexts that keep their hidden states (Context::hidden); the
// forward has moved their positions past these T tokens.
void keep_hidden(const Var& h, const TokenBatch& batch) {
  if (!batch.contexts) return;
  Tensor host;
  for (int64_t b = 0; b < batch.B; ++b) {
    Context* c = batch.contexts[b];
    if (!c || !c->hidden) continue;
    if (!host.defined()) {
      host = h->value.to_device(Device::CPU);
      if (!host.is_contiguous()) host = host.clone();
    }
    Context::HiddenRows& r = *c->hidden;
    const int64_t D = host.dim(-1), start = c->position - batch.T;
    if (r.dim != D || start < r.start || start > r.start + r.count()) {  // nothing kept fits
      r.rows.clear();
      r.dim = D;
      r.start = start;
    }
    r.rows.resize(size_t((start - r.start) * D));
    const float* src = host.f32() + b * batch.T * D;
    r.rows.insert(r.rows.end(), src, src + batch.T * D);
  }
}
}  // namespace

void Model::logits(const TokenBatch& batch, float* out, Logits which) const {
  const Var h = hidden(batch);
  keep_hidden(h, batch);
  head_logits(h, batch, which, head_weight(), out);
}

void Model::greedy(const TokenBatch& batch, int64_t* next) const {
  const Var h = hidden(batch);
  keep_hidden(h, batch);
  head_picks(h, batch, head_weight(), next);
}

void Model::forward(const int64_t* ids, int64_t T, Context* ctx, float* out, Logits which) const {
  Context* ctxs[1] = {ctx};
  logits(TokenBatch{ids, 1, T, ctx ? ctxs : nullptr}, out, which);
}

Var Model::loss(const TokenBatch& batch, const std::vector<int64_t>& targets, float z_loss) const {
  return ag::cross_entropy_head(hidden(batch), head_weight(), targets, 4096, z_loss);
}

Tensor load_mxfp4_packed(const Checkpoint& ckpt, const std::string& name, const Shape& want) {
  const Tensor packed = ckpt.get(name + "_packed"), scale = ckpt.get(name + "_scale");
  if (want.size() != 2 || want[1] % kMxfp4Block != 0)
    throw error("load", ckpt.path(), ": '", name, "' is MXFP4-packed but its shape ", shape_str(want),
                " has no multiple-of-32 columns");
  const int64_t rows = want[0], cols = want[1];
  if (packed.dtype() != DType::U8 || packed.shape() != Shape{rows, cols / 2})
    throw error("load", ckpt.path(), ": '", name, "_packed' is ", packed.describe(), ", expected U8", shape_str({rows, cols / 2}));
  if (scale.dtype() != DType::U8 || scale.shape() != Shape{rows, cols / kMxfp4Block})
    throw error("load", ckpt.path(), ": '", name, "_scale' is ", scale.describe(), ", expected U8",
                shape_str({rows, cols / kMxfp4Block}), " (E8M0 per 32 values)");
  Tensor out = Tensor::empty(want, DType::MXFP4);  // the codes, then the scales (core/quant.h)
  const int64_t n = out.numel();
  std::memcpy(out.raw(), packed.raw(), size_t(n / 2));
  std::memcpy(static_cast<uint8_t*>(out.raw()) + n / 2, scale.raw(), size_t(n / kMxfp4Block));
  return out;
}

Tensor load_mxfp4(const Checkpoint& ckpt, const std::string& name, const Shape& want) {
  return load_mxfp4_packed(ckpt, name, want).to(DType::F32);
}

namespace {
// The FP8 tensor's scale grid, checked: [⌈rows/128⌉, ⌈cols/128⌉] fp32.
Tensor fp8_scales(const Checkpoint& ckpt, const std::string& name) {
  const TensorEntry& e = ckpt.entry(name);
  const std::string sname = name + "_scale_inv";
  if (e.shape.size() != 2)
    throw error("load", ckpt.path(), ": FP8 tensor '", name, "' has shape ", shape_str(e.shape),
                "; block-scaled FP8 weights are matrices");
  if (!ckpt.has(sname))
    throw error("load", ckpt.path(), ": FP8 tensor '", name, "' has no '", sname,
                "' (k3 reads FP8 weights with one float scale per ", kFp8Block, " x ", kFp8Block, " block)");
  const int64_t rows = e.shape[0], cols = e.shape[1];
  const Shape want{(rows + kFp8Block - 1) / kFp8Block, (cols + kFp8Block - 1) / kFp8Block};
  Tensor scale = ckpt.get_f32(sname);
  if (scale.shape() != want)
    throw error("load", ckpt.path(), ": '", sname, "' has shape ", shape_str(scale.shape()), " but ", shape_str(e.shape),
                " in blocks of ", kFp8Block, " x ", kFp8Block, " needs ", shape_str(want));
  return scale;
}
}  // namespace

Tensor load_fp8_packed(const Checkpoint& ckpt, const std::string& name) {
  const Tensor scale = fp8_scales(ckpt, name);
  const Tensor codes = ckpt.get(name);
  const int64_t rows = codes.dim(0), cols = codes.dim(1), cb = cols / kFp8Block;
  K3_CHECK(cols % kFp8Block == 0, "load_fp8_packed: ", cols, " columns are not whole blocks");
  Tensor out = Tensor::empty({rows, cols}, DType::F8B128);
  std::memcpy(out.raw(), codes.raw(), size_t(rows * cols));
  // The CPU's product kernels read E4M3's NaN code as a number; a checkpoint holding one is corrupt.
  const uint8_t* c = codes.data<uint8_t>();
  for (int64_t i = 0; i < rows * cols; ++i)
    if ((c[i] & 0x7f) == 0x7f)
      throw error("load", ckpt.path(), ": FP8 tensor '", name, "' holds a NaN at [", i / cols, ", ", i % cols,
                  "]: the checkpoint is corrupt");
  float* s = reinterpret_cast<float*>(static_cast<uint8_t*>(out.raw()) + rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cb; ++j) s[r * cb + j] = scale.f32()[(r / kFp8Block) * cb + j];
  return out;
}

Tensor load_fp8_blocks(const Checkpoint& ckpt, const std::string& name) {
  const Tensor scale = fp8_scales(ckpt, name);
  const int64_t rows = ckpt.entry(name).shape[0], cols = ckpt.entry(name).shape[1], tiles = scale.dim(1);
  Tensor w = ckpt.get_f32(name);  // the FP8 values, exactly
  float* pw = w.f32();
  const float* ps = scale.f32();
  parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) pw[r * cols + c] *= ps[(r / kFp8Block) * tiles + c / kFp8Block];
  });
  return w;
}

void load_params(const Model& model, const Checkpoint& ckpt, const LoadOptions& opts) {
  // Weights are held as fp32 on the host, or packed where they are kept so, or (a placing load) in
  // their storage on the device: a model that cannot fit is refused before any is read.
  const LoadPlan& plan = opts.plan;
  if (plan.place) check_storage(model, plan.device, plan.storage);
  double need = 0;
  int64_t params = 0;
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (p.value.has_storage()) return;
    params += p.value.numel();
    Tensor held = p.value;  // its shape; its dtype what the load keeps
    if (plan.packed == PackedWeights::Keep)
      for (const auto& c : opts.alias ? opts.alias(name) : std::vector<std::string>{name}) {
        const DType fmt = ckpt.has(c) && ckpt.entry(c).dtype == DType::F8E4M3 ? DType::F8B128
                          : ckpt.has(c + "_packed")                           ? DType::MXFP4
                                                                              : DType::F32;
        if (fmt != DType::F32 && block_gemm_weight(model, name, p.value, kind, fmt)) held = Tensor::meta(p.value.shape(), fmt);
      }
    const DType dt = plan.place ? storage_of(model, name, held, kind, plan.storage) : held.dtype();
    need += double(dtype_bytes(dt, p.value.numel()));
  });
  if (plan.place && plan.device == Device::CUDA) {
    check_device_room(need);
  } else if (const auto avail = host_available_bytes(); avail && need > double(*avail)) {
    throw error("load", ckpt.path(), ": the weights need ", human_bytes(need), " on the host (", params,
                " parameters) but this machine has ", human_bytes(double(*avail)), " of memory available");
  }
  std::set<std::string> used;
  std::vector<std::string> missing;
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    std::vector<std::string> candidates = opts.alias ? opts.alias(name) : std::vector<std::string>{name};
    auto keep = [&](DType fmt) {
      return plan.packed == PackedWeights::Keep && block_gemm_weight(model, name, p.value, kind, fmt);
    };
    // The weight just read, placed where the plan wants it (the host copy freed at once).
    auto done = [&] {
      if (plan.place) p.value = placed(model, name, p.value, kind, plan.device, plan.storage);
    };
    for (const auto& c : candidates) {
      if (!ckpt.has(c)) continue;
      const TensorEntry& e = ckpt.entry(c);
      if (e.shape != p.value.shape())
        throw error("load", ckpt.path(), ": tensor '", c, "' has shape ", shape_str(e.shape), " but the config implies ",
                    shape_str(p.value.shape()), " (config.json and weights disagree?)");
      if (e.dtype == DType::F8E4M3) {  // block-scaled FP8 (DeepSeek-V3, Kimi): dequantised on load
        p.value = keep(DType::F8B128) ? load_fp8_packed(ckpt, c) : load_fp8_blocks(ckpt, c);
        used.insert(c);
        used.insert(c + "_scale_inv");
        return done();
      }
      if (e.dtype != DType::F32 && e.dtype != DType::BF16 && e.dtype != DType::F16 && e.dtype != DType::F64)
        throw error("load", ckpt.path(), ": tensor '", c, "' is stored as ", dtype_name(e.dtype),
                    "; a weight is F32, BF16, F16 or F64 (integer dtypes belong only to packed formats such as "
                    "MXFP4's '_packed' and '_scale' tensors)");
      // Stored as the device will hold it (a bf16 GEMM weight): read as it is, never inflated.
      const Tensor raw = ckpt.get(c);
      const bool as_stored = plan.place && raw.dtype() != DType::F32 &&
                             storage_of(model, name, Tensor::meta(e.shape), kind, plan.storage) == raw.dtype();
      p.value = as_stored ? raw : ckpt.get_f32(c);
      used.insert(c);
      return done();
    }
    // MXFP4-packed weights (K3's routed experts): "<name>_packed" + "<name>_scale".
    for (const auto& c : candidates) {
      if (!c.ends_with(".weight") || !ckpt.has(c + "_packed") || !ckpt.has(c + "_scale")) continue;
      p.value = keep(DType::MXFP4) ? load_mxfp4_packed(ckpt, c, p.value.shape()) : load_mxfp4(ckpt, c, p.value.shape());
      used.insert(c + "_packed");
      used.insert(c + "_scale");
      return done();
    }
    missing.push_back(candidates.front());
  });
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ... (" + std::to_string(missing.size()) + " in all)";
    throw error("load", ckpt.path(), ": missing tensors: ", list);
  }
  std::vector<std::string> extra;
  for (const auto& n : ckpt.names())
    if (!used.count(n) && !(opts.ignorable && opts.ignorable(n))) extra.push_back(n);
  if (!extra.empty())
    std::cerr << "k3: warning: " << ckpt.path() << " has " << extra.size()
              << " tensor(s) this architecture does not use, e.g. '" << extra.front() << "'\n";
}

std::vector<std::pair<std::string, Tensor>> packed_checkpoint_tensors(const std::string& name, const Tensor& w) {
  K3_CHECK(w.device() == Device::CPU && w.ndim() == 2 && is_block_dtype(w.dtype()), "packed_checkpoint_tensors: ",
           w.describe());
  const int64_t rows = w.dim(0), cols = w.dim(1), n = w.numel();
  const uint8_t* base = static_cast<const uint8_t*>(w.raw());
  if (w.dtype() == DType::MXFP4) {
    if (!name.ends_with(".weight"))
      throw error("save", "'", name, "' is MXFP4, which checkpoints store only for '.weight' tensors");
    Tensor codes = Tensor::empty({rows, cols / 2}, DType::U8), scales = Tensor::empty({rows, cols / kMxfp4Block}, DType::U8);
    std::memcpy(codes.raw(), base, size_t(n / 2));
    std::memcpy(scales.raw(), base + n / 2, size_t(n / kMxfp4Block));
    return {{name + "_packed", codes}, {name + "_scale", scales}};
  }
  // F8B128: one scale per 128 × 128 tile, as each tile's rows repeat it (how k3 quantises and loads).
  const int64_t cb = cols / kF8Block, tiles = (rows + kF8Block - 1) / kF8Block;
  Tensor codes = Tensor::empty({rows, cols}, DType::F8E4M3), scales = Tensor::empty({tiles, cb});
  std::memcpy(codes.raw(), base, size_t(n));
  const float* s = reinterpret_cast<const float*>(base + n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cb; ++j) {
      float& tile = scales.f32()[(r / kF8Block) * cb + j];
      if (r % kF8Block == 0) tile = s[r * cb + j];
      else if (std::bit_cast<uint32_t>(tile) != std::bit_cast<uint32_t>(s[r * cb + j]))
        throw error("save", "'", name, "' has FP8 scales that differ within a ", kFp8Block, " x ", kFp8Block,
                    " tile (row ", r, "), which the checkpoint layout cannot hold");
    }
  return {{name, codes}, {name + "_scale_inv", scales}};
}

void save_model(const Model& model, const std::string& dir) {
  std::vector<std::pair<std::string, Tensor>> ts;
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    const Tensor host = p.value.device() == Device::CPU ? p.value : p.value.to_device(Device::CPU);
    if (is_block_dtype(host.dtype()))
      for (auto& t : packed_checkpoint_tensors(model.checkpoint_name(name), host)) ts.push_back(std::move(t));
    else
      ts.push_back({model.checkpoint_name(name), host});
  });
  save_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  std::string tmp = dir + "/config.json.tmp";
  {
    std::ofstream out(tmp);
    out << model.config_json().dump(2) << "\n";
    if (!out) throw error("save", "cannot write ", tmp);
  }
  std::filesystem::rename(tmp, dir + "/config.json");
}

void check_weights_finite(const Model& model) {
  std::string first;
  int64_t bad_tensors = 0, bad_values = 0, first_count = 0;
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    if (!p.value.has_storage() || p.value.numel() == 0) return;
    const Tensor host = p.value.device() == Device::CPU ? p.value : p.value.to_device(Device::CPU);
    const Tensor f = host.dtype() == DType::F32 ? host : host.to(DType::F32);
    const float* x = f.f32();
    int64_t n = 0;
    for (int64_t i = 0; i < f.numel(); ++i) n += !std::isfinite(x[i]);
    if (!n) return;
    if (first.empty()) first = model.checkpoint_name(name), first_count = n;
    ++bad_tensors;
    bad_values += n;
  });
  if (bad_tensors)
    throw error("load", "the weights hold ", bad_values, " NaN or infinite value(s) in ", bad_tensors, " tensor(s), first '",
                first, "' (", first_count, " of them): the checkpoint is corrupt");
}

void materialize_params(const Model& model) {
  model.visit([](const std::string&, Node& p, ParamKind) {
    if (!p.value.has_storage() || p.value.numel() == 0) p.value = Tensor::zeros(p.value.shape());
  });
}

}  // namespace k3
