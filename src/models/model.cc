#include <cmath>
#include "models/model.h"

#include <algorithm>
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
#include "core/mxfp4.h"
#include "ops/ag.h"
#include "ops/ag_moe.h"
#include "ops/ops_cuda.h"

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

void move_to(const Model& model, Device device, DType gemm_weights) {
  if (device == Device::CUDA) device::require_cuda("model");
  if (gemm_weights != DType::F32 && (gemm_weights != DType::BF16 || device != Device::CUDA))
    throw error("model", "GEMM weights can be bf16 on CUDA only (or fp32 anywhere), not ", dtype_name(gemm_weights));
  if (device == Device::CUDA) {  // refused before the first copy, with the bytes needed
    double need = 0;
    model.visit([&](const std::string& name, Node& p, ParamKind kind) {
      if (p.value.device() == Device::CUDA || !p.value.has_storage()) return;
      const bool bf16 = gemm_weights == DType::BF16 && bf16_gemm_weight(name, p.value, kind);
      need += double(p.value.numel()) * (bf16 ? 2 : 4);
    });
    const size_t avail = device::available_bytes();
    if (need > double(avail))
      throw error("model", "the weights need ", human_bytes(need), " on the device but ", human_bytes(double(avail)),
                  " is free there");
  }
  model.visit([&](const std::string& name, Node& p, ParamKind kind) {
    if (!p.value.has_storage()) throw error("model", "parameter '", name, "' has no values to move to the device");
    const Tensor host = p.value.to_device(Device::CPU);
    const DType want = gemm_weights == DType::BF16 && bf16_gemm_weight(name, host, kind) ? DType::BF16 : DType::F32;
    p.value = (host.dtype() == want ? host : host.to(want)).to_device(device);
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
// The device logits of the hidden rows h [B·T, D] (the last row of each sequence for Last).
Tensor device_logits(Var h, const TokenBatch& batch, Logits which, const Var& head) {
  if (which == Logits::Last && batch.T > 1) {
    std::vector<int64_t> last(static_cast<size_t>(batch.B));
    for (int64_t b = 0; b < batch.B; ++b) last[size_t(b)] = (b + 1) * batch.T - 1;
    h = ag::gather_rows(h, last);
  }
  Tensor lg = ag::linear(h, head, nullptr, WeightLayout::OutIn)->value;
  K3_CHECK(lg.dtype() == DType::F32, "logits: the head gave ", lg.describe());
  return lg;
}
}  // namespace

void Model::logits(const TokenBatch& batch, float* out, Logits which) const {
  Var h = hidden(batch);  // [B*T, D]
  const int64_t D = h->value.dim(-1), V = vocab_size();
  profile::Scope scope("lm head");
  if (h->value.device() == Device::CUDA) {
    // Straight into the caller's buffer (reused step after step: no fresh pages, no second copy).
    const Tensor lg = device_logits(h, batch, which, head_weight());
    device::download(out, lg.raw(), lg.nbytes());
    return;
  }
  if (which == Logits::Last && batch.T > 1) {
    Tensor last = Tensor::empty({batch.B, D});
    for (int64_t b = 0; b < batch.B; ++b)
      std::memcpy(last.f32() + b * D, h->value.f32() + ((b + 1) * batch.T - 1) * D, size_t(D) * 4);
    h = constant(std::move(last));
  }
  const int64_t rows = h->value.numel() / D;
  linear_forward(h->value.f32(), rows, D, V, head_weight()->value, WeightLayout::OutIn, nullptr, out);
}

namespace {
// The device half of a greedy step: every kernel of it, the B picks left in ids (device).
void device_greedy(const Model& m, const TokenBatch& batch, int64_t* ids) {
  if constexpr (device::kCudaBuilt) {
    Var h = m.hidden(batch);
    std::optional<profile::Scope> scope(std::in_place, "lm head");
    const Tensor lg = device_logits(h, batch, Logits::Last, m.head_weight());
    scope.emplace("greedy pick");
    cuda::argmax_rows(lg.cuda_f32(), batch.B, m.vocab_size(), ids);
  } else {
    device::require_cuda("generate");
  }
}
}  // namespace

void Model::greedy(const TokenBatch& batch, int64_t* next) const {
  const int64_t V = vocab_size();
  if constexpr (device::kCudaBuilt) {
    if (head_weight()->value.device() == Device::CUDA) {
      device::Buffer ids(size_t(batch.B) * sizeof(int64_t));
      device_greedy(*this, batch, ids.as<int64_t>());
      device::download(next, ids.get(), size_t(batch.B) * sizeof(int64_t));
      return;
    }
  }
  std::vector<float> out(static_cast<size_t>(batch.B * V));
  logits(batch, out.data(), Logits::Last);
  profile::Scope scope("greedy pick");
  parallel_for(batch.B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = out.data() + b * V;
      next[b] = int64_t(std::max_element(row, row + V) - row);
    }
  });
}

Decoder::Decoder(const Model& model, std::vector<Context*> contexts, bool use_graph, Output output)
    : model_(model), contexts_(std::move(contexts)), use_graph_(use_graph), output_(output) {
  if (contexts_.empty()) throw error("decode", "a decoder needs at least one context");
  for (Context* c : contexts_)
    if (!c) throw error("decode", "a decoder was given a null context");
}
Decoder::~Decoder() = default;

bool Decoder::replaying() const { return graph_ && graph_->ready(); }

size_t Decoder::out_bytes() const {
  const size_t B = contexts_.size();
  return output_ == Output::Picks ? B * sizeof(int64_t) : B * size_t(model_.vocab_size()) * sizeof(float);
}

void Decoder::step(const int64_t* ids, int64_t* next) {
  if (output_ != Output::Picks) throw error("decode", "this decoder gives logits, not picks");
  run(ids, next);
}
void Decoder::step(const int64_t* ids, float* logits) {
  if (output_ != Output::Logits) throw error("decode", "this decoder gives picks, not logits");
  run(ids, logits);
}

void Decoder::eager(const int64_t* ids, void* out) {
  const TokenBatch batch{ids, int64_t(contexts_.size()), 1, contexts_.data()};
  if (output_ == Output::Picks)
    model_.greedy(batch, static_cast<int64_t*>(out));
  else
    model_.logits(batch, static_cast<float*>(out), Logits::Last);
}

void Decoder::run(const int64_t* ids, void* out) {
  const int64_t B = int64_t(contexts_.size());
  const bool device = model_.head_weight()->value.device() == Device::CUDA;
  // The first step runs eagerly: the allocator, GEMM plans and lazily made copies settle first.
  if (!device || !use_graph_ || !refusal_.empty() || steps_ == 0) {
    eager(ids, out);
    ++steps_;
    return;
  }
  if (graph_ && counts() != after_) graph_.reset();  // moved outside the decoder: capture again
  if (!graph_) {
    capture(ids, out);
    ++steps_;
    return;
  }
  for (Context* c : contexts_) {  // the eager step's checks, before anything moves
    if (c->position + 1 > model_.max_positions())
      throw error("decode", "position ", c->position + 1, " exceeds the model's ", model_.max_positions(), " positions");
    for (const auto& m : c->layers)
      if (m->length() + 1 > m->capacity())
        throw error(std::string(memory_kind_name(m->kind())), "context of ", m->length() + 1,
                    " tokens exceeds the limit of ", m->capacity());
  }
  for (int64_t b = 0; b < B; ++b)  // the eager step checks them in the embedding; the graph cannot
    if (ids[b] < 0 || ids[b] >= model_.vocab_size())
      throw error("decode", "token id ", ids[b], " is outside the vocabulary [0, ", model_.vocab_size(), ")");
  try {
    graph_->set_input(ids, B);
    graph_->replay();
    device::download(out, result_->get(), out_bytes());
  } catch (...) {
    graph_.reset();  // whatever ran, the host's counts did not move: a later step captures again
    throw;
  }
  for (Context* c : contexts_) {
    c->position += 1;
    for (auto& m : c->layers) m->set_length(m->length() + 1);
  }
  after_ = counts();
  ++steps_;
}

// With each memory's identity: a context whose memories were replaced (a clone assigned over it,
// a new context prefilled to the same length) holds other device arrays than the graph's tables.
std::vector<int64_t> Decoder::counts() const {
  std::vector<int64_t> v;
  for (const Context* c : contexts_) {
    v.push_back(c->position);
    for (const auto& m : c->layers) v.push_back(m->length()), v.push_back(int64_t(reinterpret_cast<intptr_t>(m.get())));
  }
  return v;
}

void Decoder::capture(const int64_t* ids, void* out) {
  if constexpr (device::kCudaBuilt) {
    const TokenBatch batch{ids, int64_t(contexts_.size()), 1, contexts_.data()};
    // What the host's bookkeeping was, to set back if the capture or its first replay fails.
    const std::vector<int64_t> before = counts();
    auto set_back = [&] {
      size_t i = 0;  // counts()'s order: a position, then each memory's length and identity
      for (Context* c : contexts_) {
        c->position = before[i++];
        for (auto& m : c->layers) m->set_length(before[i]), i += 2;
      }
    };
    result_ = std::make_unique<device::Buffer>(out_bytes());
    graph_ = std::make_unique<device::Graph>();
    try {
      graph_->begin(/*step_tokens=*/1);
      if (output_ == Output::Picks) {
        device_greedy(model_, batch, result_->as<int64_t>());
      } else {  // lg is freed (into the capture's reserve) before the capture ends: its rows are
                // copied into the decoder's own buffer, which the replays download
        Var h = model_.hidden(batch);
        const profile::Scope scope("lm head");
        const Tensor lg = device_logits(h, batch, Logits::Last, model_.head_weight());
        device::copy(result_->get(), lg.raw(), out_bytes());
      }
      graph_->end();
    } catch (const std::exception& e) {
      graph_.reset();  // ends the capture, releases what it held
      refusal_ = e.what();
      set_back();
      eager(ids, out);
      return;
    }
    try {
      graph_->replay();  // the captured step itself
      device::download(out, result_->get(), out_bytes());
    } catch (...) {
      graph_.reset();  // as a failed replay: the counts set back, a later step captures again
      set_back();
      throw;
    }
    after_ = counts();
  } else {
    eager(ids, out);
  }
}

void Model::forward(const int64_t* ids, int64_t T, Context* ctx, float* out, Logits which) const {
  Context* ctxs[1] = {ctx};
  logits(TokenBatch{ids, 1, T, ctx ? ctxs : nullptr}, out, which);
}

Var Model::loss(const TokenBatch& batch, const std::vector<int64_t>& targets, float z_loss) const {
  return ag::cross_entropy_head(hidden(batch), head_weight(), targets, 4096, z_loss);
}

Tensor load_mxfp4(const Checkpoint& ckpt, const std::string& name, const Shape& want) {
  const Tensor packed = ckpt.get(name + "_packed"), scale = ckpt.get(name + "_scale");
  if (want.size() != 2 || want[1] % 32 != 0)
    throw error("load", ckpt.path(), ": '", name, "' is MXFP4-packed but its shape ", shape_str(want),
                " has no multiple-of-32 columns");
  const int64_t rows = want[0], cols = want[1];
  if (packed.dtype() != DType::U8 || packed.shape() != Shape{rows, cols / 2})
    throw error("load", ckpt.path(), ": '", name, "_packed' is ", packed.describe(), ", expected U8", shape_str({rows, cols / 2}));
  if (scale.dtype() != DType::U8 || scale.shape() != Shape{rows, cols / 32})
    throw error("load", ckpt.path(), ": '", name, "_scale' is ", scale.describe(), ", expected U8", shape_str({rows, cols / 32}),
                " (E8M0 per 32 values)");
  Tensor out = Tensor::empty(want);
  dequantize_mxfp4(packed.data<uint8_t>(), scale.data<uint8_t>(), rows, cols, out.f32());
  return out;
}

void load_params(const Model& model, const Checkpoint& ckpt, const LoadOptions& opts) {
  // Weights are held as fp32 on the host: a model that cannot fit is refused before any is read.
  double need = 0;
  int64_t params = 0;
  model.visit([&](const std::string&, Node& p, ParamKind) {
    if (!p.value.has_storage()) need += 4.0 * double(p.value.numel()), params += p.value.numel();
  });
  if (const auto avail = host_available_bytes(); avail && need > double(*avail))
    throw error("load", ckpt.path(), ": the weights need ", human_bytes(need), " as fp32 (", params,
                " parameters) but this machine has ", human_bytes(double(*avail)), " of memory available");
  std::set<std::string> used;
  std::vector<std::string> missing;
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    std::vector<std::string> candidates = opts.alias ? opts.alias(name) : std::vector<std::string>{name};
    for (const auto& c : candidates) {
      if (!ckpt.has(c)) continue;
      const TensorEntry& e = ckpt.entry(c);
      if (e.shape != p.value.shape())
        throw error("load", ckpt.path(), ": tensor '", c, "' has shape ", shape_str(e.shape), " but the config implies ",
                    shape_str(p.value.shape()), " (config.json and weights disagree?)");
      if (e.dtype == DType::F8E4M3)
        throw error("load", ckpt.path(), ": tensor '", c, "' is stored as FP8 (F8_E4M3); block-scaled FP8 weights "
                    "(weight_scale_inv) are not supported yet: convert the checkpoint to bf16 first");
      if (e.dtype != DType::F32 && e.dtype != DType::BF16 && e.dtype != DType::F16 && e.dtype != DType::F64)
        throw error("load", ckpt.path(), ": tensor '", c, "' is stored as ", dtype_name(e.dtype),
                    "; a weight is F32, BF16, F16 or F64 (integer dtypes belong only to packed formats such as "
                    "MXFP4's '_packed' and '_scale' tensors)");
      p.value = ckpt.get_f32(c);
      used.insert(c);
      return;
    }
    // MXFP4-packed weights (K3's routed experts): "<name>_packed" + "<name>_scale".
    for (const auto& c : candidates) {
      if (!c.ends_with(".weight") || !ckpt.has(c + "_packed") || !ckpt.has(c + "_scale")) continue;
      p.value = load_mxfp4(ckpt, c, p.value.shape());
      used.insert(c + "_packed");
      used.insert(c + "_scale");
      return;
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

void save_model(const Model& model, const std::string& dir) {
  std::vector<std::pair<std::string, Tensor>> ts;
  model.visit([&](const std::string& name, Node& p, ParamKind) {
    ts.push_back({model.checkpoint_name(name), p.value.device() == Device::CPU ? p.value : p.value.to_device(Device::CPU)});
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
