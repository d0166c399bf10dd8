// `k3 op run IN.safetensors --output OUT.safetensors`: runs one op on the inputs of a
// fixture-shaped file (fixtures/README.md) and writes its outputs and, when the file holds
// cotangents, the gradients grad_<input> of every input. The op and its settings come from the
// JSON in the file's "fixture" metadata key (or --op). External acceptance checks drive this
// command, so its file contract is kept stable:
//
//   linear_attn       q, k (already feature-mapped), v [, h0] [, z0]  → o, ht [, zt]   settings: scale, normalize, eps
//   delta_rule        q, k, v, beta [, h0]                          → o, ht
//   gated_delta_rule  q, k, v, beta, g [B,T,HV] [, h0]              → o, ht
//   kda               q, k, v, beta, g [B,T,HV,K] [, h0]            → o, ht
//     cotangents do [, dht] [, dzt] → grad_q, grad_k, grad_v, grad_beta, grad_g, grad_h0, grad_z0
//     optional cu_seqlens (int) for packed sequences (B = 1)
//   kda_gate          g_raw [.., H, K], A_log [H], dt_bias [H·K]     → g_softplus, g_lowerbound  setting: lower_bound (−5)
//     cotangents dg_softplus / dg_lowerbound → grad_g_raw, grad_A_log, grad_dt_bias
//   attnres           query [D], rmsw [D], r0 .. r{J−1} [.., D]     → o   setting: eps (1e-5)
//     cotangent do → grad_query, grad_rmsw, grad_r0 ..
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "core/device.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "mixers/linear/delta_core.h"
#include "ops/gates.h"
#include "ops/ops_cuda.h"
#include "residual/attnres_cuda.h"
#include "residual/attnres.h"

namespace k3::cli {
namespace {

constexpr const char* kWho = "op";

struct OpArgs {
  std::string input, output, op, impl = "chunked", dtype = "f32";
  int chunk = 64;
  RuntimeOptions runtime;
};

using Named = std::vector<std::pair<std::string, Tensor>>;

// "r3", "grad_r3": built with append (GCC 12 warns falsely on "literal" + std::string&&).
std::string indexed(const char* prefix, size_t j) { return std::string(prefix).append(std::to_string(j)); }

// Parameters keep fp32 under --dtype bf16; activations and cotangents are rounded to bf16.
bool is_parameter(const std::string& name) {
  return name == "A_log" || name == "dt_bias" || name == "query" || name == "rmsw";
}

Tensor rounded_to_bf16(const Tensor& t) {
  Tensor r = t.clone();
  for (int64_t i = 0; i < r.numel(); ++i) r.f32()[i] = round_to_bf16(r.f32()[i]);
  return r;
}

class Inputs {
 public:
  enum class Rounding : uint8_t { None, Bf16Activations };
  Inputs(const SafeTensors& st, std::string op, Rounding rounding = Rounding::None)
      : st_(st), op_(std::move(op)), rounding_(rounding) {}
  bool has(const std::string& name) const { return st_.has(name); }
  Tensor need(const std::string& name) const {
    if (!st_.has(name))
      throw error(kWho, st_.path(), ": op '", op_, "' needs a tensor named '", name, "', which the file lacks");
    return get(name);
  }
  Tensor maybe(const std::string& name) const { return st_.has(name) ? get(name) : Tensor(); }

 private:
  Tensor get(const std::string& name) const {
    Tensor t = st_.get_f32(name);
    return rounding_ == Rounding::Bf16Activations && !is_parameter(name) ? rounded_to_bf16(t) : t;
  }
  const SafeTensors& st_;
  std::string op_;
  Rounding rounding_;
};

#if defined(K3_HAS_CUDA)
device::Buffer up(const Tensor& t) { return t.defined() ? device::upload_values(t.f32(), t.numel(), device::Storage::F32) : device::Buffer(); }
Tensor down(const device::Buffer& b, const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  device::download_values(t.f32(), b, t.numel(), device::Storage::F32);
  return t;
}

void run_kda_gate_cuda(const Tensor& graw, const Tensor& A_log, const Tensor& dt_bias, float lb, const Tensor& dgs,
                       const Tensor& dgl, const GateShape& s, Named& out) {
  const device::Buffer x = up(graw), A = up(A_log), b = up(dt_bias);
  device::Buffer gs(graw.nbytes()), gl(graw.nbytes());
  cuda::gate_softplus_forward(x.as<float>(), A.as<float>(), b.as<float>(), gs.as<float>(), s);
  cuda::gate_lowerbound_forward(x.as<float>(), A.as<float>(), b.as<float>(), lb, gl.as<float>(), s);
  out.emplace_back("g_softplus", down(gs, graw.shape()));
  out.emplace_back("g_lowerbound", down(gl, graw.shape()));
  if (!dgs.defined() && !dgl.defined()) return;
  device::Buffer dx = device::zeros_f32(graw.numel()), dA = device::zeros_f32(A_log.numel()),
                 db = device::zeros_f32(dt_bias.numel());
  if (dgs.defined()) {
    const device::Buffer d = up(dgs);
    cuda::gate_softplus_backward(x.as<float>(), A.as<float>(), b.as<float>(), d.as<float>(), dx.as<float>(),
                                 dA.as<float>(), db.as<float>(), s);
  }
  if (dgl.defined()) {
    const device::Buffer d = up(dgl);
    cuda::gate_lowerbound_backward(x.as<float>(), A.as<float>(), b.as<float>(), lb, d.as<float>(), dx.as<float>(),
                                   dA.as<float>(), db.as<float>(), s);
  }
  out.emplace_back("grad_g_raw", down(dx, graw.shape()));
  out.emplace_back("grad_A_log", down(dA, A_log.shape()));
  out.emplace_back("grad_dt_bias", down(db, dt_bias.shape()));
}

void run_attnres_cuda(const std::vector<Tensor>& src, const Tensor& query, const Tensor& rmsw, float eps,
                      const Tensor& d_o, const AttnResShape& s, Named& out) {
  std::vector<device::Buffer> bufs;
  std::vector<const float*> ptrs;
  for (const Tensor& r : src) {
    bufs.push_back(up(r));
    ptrs.push_back(bufs.back().as<float>());
  }
  const device::Buffer q = up(query), w = up(rmsw);
  device::Buffer o(src[0].nbytes());
  cuda::attnres_forward(ptrs, q.as<float>(), w.as<float>(), eps, o.as<float>(), s);
  out.emplace_back("o", down(o, src[0].shape()));
  if (!d_o.defined()) return;
  const device::Buffer dy = up(d_o);
  device::Buffer dq = device::zeros_f32(query.numel()), dw = device::zeros_f32(rmsw.numel());
  std::vector<device::Buffer> dsrc;
  std::vector<float*> dptrs;
  for (const Tensor& r : src) {
    dsrc.push_back(device::zeros_f32(r.numel()));
    dptrs.push_back(dsrc.back().as<float>());
  }
  cuda::attnres_backward(ptrs, q.as<float>(), w.as<float>(), eps, dy.as<float>(), dptrs, dq.as<float>(),
                         dw.as<float>(), s);
  out.emplace_back("grad_query", down(dq, query.shape()));
  out.emplace_back("grad_rmsw", down(dw, rmsw.shape()));
  for (size_t j = 0; j < dsrc.size(); ++j) out.emplace_back(indexed("grad_r", j), down(dsrc[j], src[j].shape()));
}
#else
[[noreturn]] void no_cuda() { device::require_cuda(kWho); throw error(kWho, "unreachable"); }
void run_kda_gate_cuda(const Tensor&, const Tensor&, const Tensor&, float, const Tensor&, const Tensor&,
                       const GateShape&, Named&) { no_cuda(); }
void run_attnres_cuda(const std::vector<Tensor>&, const Tensor&, const Tensor&, float, const Tensor&,
                      const AttnResShape&, Named&) { no_cuda(); }
#endif

void run_delta(const std::string& op, const nlohmann::json& meta, const Inputs& x, const OpArgs& args, Named& out) {
  using namespace k3::linear;
  DeltaOptions o;
  if (op == "linear_attn") {
    o.write = Write::Additive;
    o.normalize = meta.value("normalize", false) ? Normalize::On : Normalize::Off;
  } else if (op == "gated_delta_rule") {
    o.decay = Decay::Scalar;
  } else if (op == "kda") {
    o.decay = Decay::PerChannel;
  }
  o.scale = meta.value("scale", 0.0f);
  o.eps = meta.value("eps", 1e-10f);
  o.chunk = args.chunk;
  if (args.runtime.device == "cuda") o.device = Device::CUDA;
  o.io_dtype = args.dtype == "bf16" ? DType::BF16 : DType::F32;
  const Impl impl = args.impl == "recurrent" ? Impl::Recurrent : Impl::Chunked;

  DeltaInputs in;
  in.q = x.need("q");  // [B, T, H, K]
  in.k = x.need("k");  // [B, T, H, K]
  in.v = x.need("v");  // [B, T, HV, V]
  if (o.write == Write::Delta) in.beta = x.need("beta");  // [B, T, HV]
  if (o.decay != Decay::None) in.g = x.need("g");         // [B, T, HV(, K)]
  in.h0 = x.maybe("h0");                                  // [N, HV, K, V]
  if (o.normalize == Normalize::On) in.z0 = x.maybe("z0");  // [N, HV, K]
  if (x.has("cu_seqlens")) {
    const Tensor cu = x.need("cu_seqlens");  // [N + 1] (converted to fp32, exact below 2^24)
    for (int64_t i = 0; i < cu.numel(); ++i) in.cu_seqlens.push_back(int64_t(cu.f32()[i]));
  }
  DeltaOutputs y = delta_forward(in, o, impl);
  out.emplace_back("o", y.o);
  out.emplace_back("ht", y.ht);
  if (y.zt.defined()) out.emplace_back("zt", y.zt);

  DeltaCotangents c{x.maybe("do"), x.maybe("dht"), x.maybe("dzt")};
  if (!c.d_o.defined() && !c.dht.defined() && !c.dzt.defined()) return;
  DeltaGrads g = delta_backward(in, c, o, impl);
  out.emplace_back("grad_q", g.dq);
  out.emplace_back("grad_k", g.dk);
  out.emplace_back("grad_v", g.dv);
  if (in.beta.defined()) out.emplace_back("grad_beta", g.dbeta);
  if (in.g.defined()) out.emplace_back("grad_g", g.dg);
  if (in.h0.defined()) out.emplace_back("grad_h0", g.dh0);
  if (in.z0.defined()) out.emplace_back("grad_z0", g.dz0);
}

void run_kda_gate(const nlohmann::json& meta, const Inputs& x, bool cuda, Named& out) {
  const Tensor graw = x.need("g_raw");     // [.., H, K]
  const Tensor A_log = x.need("A_log");    // [H]
  const Tensor dt_bias = x.need("dt_bias");  // [H·K]
  const int64_t H = A_log.numel();
  if (H == 0 || dt_bias.numel() % H != 0)
    throw error(kWho, "kda_gate: dt_bias has ", dt_bias.numel(), " values, not a multiple of H = ", H, " (A_log)");
  const int64_t K = dt_bias.numel() / H;
  if (graw.ndim() < 1 || graw.numel() % (H * K) != 0 || (graw.dim(-1) != K && graw.dim(-1) != H * K))
    throw error(kWho, "kda_gate: g_raw ", graw.describe(), " must end in [H, K] = [", H, ", ", K, "] or [H·K]");
  const float lb = meta.value("lower_bound", -5.0f);
  const GateShape s{graw.numel() / (H * K), H, K};
  Tensor gs = Tensor::empty(graw.shape()), gl = Tensor::empty(graw.shape());
  const Tensor dgs = x.maybe("dg_softplus"), dgl = x.maybe("dg_lowerbound");
  if (dgs.defined()) expect_shape(dgs, graw.shape(), "op: dg_softplus");
  if (dgl.defined()) expect_shape(dgl, graw.shape(), "op: dg_lowerbound");
  if (cuda) {
    run_kda_gate_cuda(graw, A_log, dt_bias, lb, dgs, dgl, s, out);
    return;
  }
  gate_softplus_forward(graw.f32(), A_log.f32(), dt_bias.f32(), gs.f32(), s);
  gate_lowerbound_forward(graw.f32(), A_log.f32(), dt_bias.f32(), lb, gl.f32(), s);
  out.emplace_back("g_softplus", gs);
  out.emplace_back("g_lowerbound", gl);
  if (!dgs.defined() && !dgl.defined()) return;
  Tensor dx = Tensor::zeros(graw.shape()), dA = Tensor::zeros(A_log.shape()), db = Tensor::zeros(dt_bias.shape());
  if (dgs.defined()) {
    gate_softplus_backward(graw.f32(), A_log.f32(), dt_bias.f32(), dgs.f32(), dx.f32(), dA.f32(), db.f32(), s);
  }
  if (dgl.defined()) {
    gate_lowerbound_backward(graw.f32(), A_log.f32(), dt_bias.f32(), lb, dgl.f32(), dx.f32(), dA.f32(), db.f32(), s);
  }
  out.emplace_back("grad_g_raw", dx);
  out.emplace_back("grad_A_log", dA);
  out.emplace_back("grad_dt_bias", db);
}

void run_attnres(const nlohmann::json& meta, const Inputs& x, bool cuda, Named& out) {
  const Tensor query = x.need("query");  // [D]
  const Tensor rmsw = x.need("rmsw");    // [D]
  const int64_t D = query.numel();
  expect_shape(rmsw, {D}, "op: attnres rmsw");
  std::vector<Tensor> src;  // J × [.., D]
  const int64_t J = meta.value("sources", int64_t(-1));
  for (int64_t j = 0; J < 0 ? x.has(indexed("r", size_t(j))) : j < J; ++j) src.push_back(x.need(indexed("r", size_t(j))));
  if (src.empty()) throw error(kWho, "attnres: no sources r0, r1, ... in the file");
  for (const Tensor& r : src)
    if (r.ndim() < 1 || r.dim(-1) != D || r.shape() != src[0].shape())
      throw error(kWho, "attnres: sources must share one shape [.., D = ", D, "], got ", r.describe());
  const AttnResShape s{src[0].numel() / D, D};
  const float eps = meta.value("eps", 1e-5f);
  const Tensor d_o = x.maybe("do");
  if (d_o.defined()) expect_shape(d_o, src[0].shape(), "op: attnres do");
  if (cuda) {
    run_attnres_cuda(src, query, rmsw, eps, d_o, s, out);
    return;
  }
  std::vector<const float*> ptrs;
  for (const Tensor& r : src) ptrs.push_back(r.f32());
  Tensor o = Tensor::empty(src[0].shape());  // [.., D]
  attnres_forward(ptrs, query.f32(), rmsw.f32(), eps, o.f32(), s);
  out.emplace_back("o", o);
  if (!d_o.defined()) return;
  Tensor dq = Tensor::zeros({D}), dw = Tensor::zeros({D});
  std::vector<Tensor> dsrc;
  std::vector<float*> dptrs;
  for (const Tensor& r : src) {
    dsrc.push_back(Tensor::zeros(r.shape()));
    dptrs.push_back(dsrc.back().f32());
  }
  attnres_backward(ptrs, query.f32(), rmsw.f32(), eps, d_o.f32(), dptrs, dq.f32(), dw.f32(), s);
  out.emplace_back("grad_query", dq);
  out.emplace_back("grad_rmsw", dw);
  for (size_t j = 0; j < dsrc.size(); ++j) out.emplace_back(indexed("grad_r", j), dsrc[j]);
}

void run_op(const OpArgs& args) {
  apply_runtime_options(args.runtime, DeviceSupport::CpuAndCuda);
  const bool cuda = args.runtime.device == "cuda";
  const SafeTensors st = SafeTensors::open(args.input);
  nlohmann::json meta = nlohmann::json::object();
  if (auto it = st.metadata().find("fixture"); it != st.metadata().end()) {
    try {
      meta = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception& e) {
      throw error(kWho, args.input, ": the \"fixture\" metadata is not valid JSON (", e.what(), ")");
    }
    if (!meta.is_object()) throw error(kWho, args.input, ": the \"fixture\" metadata must be a JSON object");
  }
  std::string op = args.op;
  if (op.empty()) {
    if (!meta.contains("op") || !meta["op"].is_string())
      throw error(kWho, args.input, ": no op named (no \"fixture\" metadata with an \"op\" field); pass --op");
    op = meta["op"].get<std::string>();
  }
  if (args.dtype == "bf16" && !cuda)
    throw error(kWho, "--dtype bf16 is a storage option of the CUDA kernels; add --device cuda (or use --dtype f32)");
  const Inputs x(st, op);
  const Inputs x_bf16(st, op, args.dtype == "bf16" ? Inputs::Rounding::Bf16Activations : Inputs::Rounding::None);
  Named out;
  try {
    if (op == "linear_attn" || op == "delta_rule" || op == "gated_delta_rule" || op == "kda")
      run_delta(op, meta, x, args, out);
    else if (op == "kda_gate")
      run_kda_gate(meta, x_bf16, cuda, out);
    else if (op == "attnres")
      run_attnres(meta, x, cuda, out);  // sources: the fp32 residual stream
    else
      throw error(kWho, "unknown op '", op,
                  "'; known: linear_attn, delta_rule, gated_delta_rule, kda, kda_gate, attnres");
  } catch (const nlohmann::json::exception& e) {
    throw error(kWho, args.input, ": a setting in the \"fixture\" metadata has the wrong type (", e.what(), ")");
  }
  nlohmann::json info = {{"op", op},         {"impl", args.impl},   {"chunk", args.chunk},
                         {"input", args.input}, {"device", args.runtime.device}, {"dtype", args.dtype}};
  save_safetensors(args.output, out, {{"k3_op", info.dump()}});
}

}  // namespace

void register_op(CLI::App& app) {
  CLI::App* op = app.add_subcommand("op", "Run a single op (token mixers, gates, AttnRes) on tensors in a file");
  op->require_subcommand(1);
  auto args = std::make_shared<OpArgs>();
  CLI::App* run = op->add_subcommand("run", "Run the op named in IN's \"fixture\" metadata; write outputs and gradients");
  run->add_option("input", args->input, "Input .safetensors (inputs, optional cotangents do/dht)")
      ->required()
      ->check(CLI::ExistingFile);
  run->add_option("--output,-o", args->output, "Output .safetensors")->required();
  run->add_option("--op", args->op, "Op name, overriding the file's metadata");
  run->add_option("--impl", args->impl, "Token-mixer implementation")->check(CLI::IsMember({"chunked", "recurrent"}));
  run->add_option("--chunk", args->chunk, "Chunk length of the chunked form")->check(CLI::Range(1, 256));
  run->add_option("--dtype", args->dtype,
                  "Storage of the op's activations on the GPU: f32, or bf16 (q/k/v/o and the gates' inputs; "
                  "β, log-decays, states, statistics, gradients and AttnRes's residual-stream sources stay fp32)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  add_runtime_options(run, args->runtime);
  run->callback([args] { run_op(*args); });
}

}  // namespace k3::cli
