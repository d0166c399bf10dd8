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
#include "core/error.h"
#include "io/safetensors.h"
#include "mixers/linear/delta_core.h"
#include "ops/gates.h"
#include "residual/attnres.h"

namespace k3::cli {
namespace {

constexpr const char* kWho = "op";

struct OpArgs {
  std::string input, output, op, impl = "chunked";
  int chunk = 64;
  RuntimeOptions runtime;
};

using Named = std::vector<std::pair<std::string, Tensor>>;

// "r3", "grad_r3": built with append (GCC 12 warns falsely on "literal" + std::string&&).
std::string indexed(const char* prefix, size_t j) { return std::string(prefix).append(std::to_string(j)); }

class Inputs {
 public:
  Inputs(const SafeTensors& st, std::string op) : st_(st), op_(std::move(op)) {}
  bool has(const std::string& name) const { return st_.has(name); }
  Tensor need(const std::string& name) const {
    if (!st_.has(name))
      throw error(kWho, st_.path(), ": op '", op_, "' needs a tensor named '", name, "', which the file lacks");
    return st_.get_f32(name);
  }
  Tensor maybe(const std::string& name) const { return st_.has(name) ? st_.get_f32(name) : Tensor(); }

 private:
  const SafeTensors& st_;
  std::string op_;
};

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

void run_kda_gate(const nlohmann::json& meta, const Inputs& x, Named& out) {
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
  gate_softplus_forward(graw.f32(), A_log.f32(), dt_bias.f32(), gs.f32(), s);
  gate_lowerbound_forward(graw.f32(), A_log.f32(), dt_bias.f32(), lb, gl.f32(), s);
  out.emplace_back("g_softplus", gs);
  out.emplace_back("g_lowerbound", gl);
  const Tensor dgs = x.maybe("dg_softplus"), dgl = x.maybe("dg_lowerbound");
  if (!dgs.defined() && !dgl.defined()) return;
  Tensor dx = Tensor::zeros(graw.shape()), dA = Tensor::zeros(A_log.shape()), db = Tensor::zeros(dt_bias.shape());
  if (dgs.defined()) {
    expect_shape(dgs, graw.shape(), "op: dg_softplus");
    gate_softplus_backward(graw.f32(), A_log.f32(), dt_bias.f32(), dgs.f32(), dx.f32(), dA.f32(), db.f32(), s);
  }
  if (dgl.defined()) {
    expect_shape(dgl, graw.shape(), "op: dg_lowerbound");
    gate_lowerbound_backward(graw.f32(), A_log.f32(), dt_bias.f32(), lb, dgl.f32(), dx.f32(), dA.f32(), db.f32(), s);
  }
  out.emplace_back("grad_g_raw", dx);
  out.emplace_back("grad_A_log", dA);
  out.emplace_back("grad_dt_bias", db);
}

void run_attnres(const nlohmann::json& meta, const Inputs& x, Named& out) {
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
  std::vector<const float*> ptrs;
  for (const Tensor& r : src) ptrs.push_back(r.f32());
  Tensor o = Tensor::empty(src[0].shape());  // [.., D]
  attnres_forward(ptrs, query.f32(), rmsw.f32(), eps, o.f32(), s);
  out.emplace_back("o", o);
  const Tensor d_o = x.maybe("do");
  if (!d_o.defined()) return;
  expect_shape(d_o, src[0].shape(), "op: attnres do");
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
  if (args.runtime.device == "cuda")
    throw error(kWho, "--device cuda: this k3 was built without CUDA (configure with -DK3_CUDA=ON); use --device cpu");
  apply_runtime_options(args.runtime);
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
  const Inputs x(st, op);
  Named out;
  try {
    if (op == "linear_attn" || op == "delta_rule" || op == "gated_delta_rule" || op == "kda")
      run_delta(op, meta, x, args, out);
    else if (op == "kda_gate")
      run_kda_gate(meta, x, out);
    else if (op == "attnres")
      run_attnres(meta, x, out);
    else
      throw error(kWho, "unknown op '", op,
                  "'; known: linear_attn, delta_rule, gated_delta_rule, kda, kda_gate, attnres");
  } catch (const nlohmann::json::exception& e) {
    throw error(kWho, args.input, ": a setting in the \"fixture\" metadata has the wrong type (", e.what(), ")");
  }
  nlohmann::json info = {{"op", op}, {"impl", args.impl}, {"chunk", args.chunk}, {"input", args.input}};
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
  add_runtime_options(run, args->runtime);
  run->callback([args] { run_op(*args); });
}

}  // namespace k3::cli
