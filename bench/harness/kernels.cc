// The harness of `k3 bench kernels`: k3's CUDA kernels timed on this GPU, each figure beside its
// ceiling (copy bandwidth and bf16 GEMM rate, both measured here first) and beside its anchor:
// the figures of ../shared/docs/anchors.md, or, with --versus FILE, the same shapes timed in the
// same session by flash-linear-attention and PyTorch (tools/gpu/fla_bench.py writes FILE; llm.c's
// tokens/s, timed by hand beside k3, go in as llmc_train_B<batch>_tok_s). Median of --reps timed
// runs after warm-up, timed with CUDA events. Without a GPU it says so and exits non-zero.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/harness/kernels.h"
#include "core/device.h"
#include "core/error.h"
#include "core/random.h"

#if defined(K3_HAS_CUDA)
#include "bench/harness/gpt2_cuda.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/mixers_cuda.h"
#include "models/gpt2.h"
#include "models/registry.h"
#include "ops/ops_cuda.h"
#endif

namespace k3::bench {

namespace {

// The command has no CPU form: its errors say what it needs and where the CPU benchmarks are (the
// shared require_cuda message would point at a --device option this command does not have).
constexpr const char* kCpuBenchmarks =
    "the CPU benchmarks are `k3 bench decode`, `k3 bench recall` and `k3 bench memory`";

#if defined(K3_HAS_CUDA)
template <class F>
double median_ms(int reps, F&& f) {
  for (int i = 0; i < 3; ++i) f();  // warm-up
  device::synchronize();
  std::vector<double> t;
  device::Timer timer;
  for (int i = 0; i < reps; ++i) {
    timer.start();
    f();
    t.push_back(timer.stop_ms());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// n values uniform in [lo, hi). Past 2^24 values the buffer repeats its first 2^24 (copied on the
// device): the kernels timed here read every byte whatever it holds, and drawing the billions of
// values of a 128K-row cache at 256 sequences on the host took a minute per figure.
device::Buffer random_values(Rng& rng, int64_t n, float lo, float hi, device::Storage st) {
  const int64_t drawn = std::min<int64_t>(n, int64_t(1) << 24);
  std::vector<float> h(static_cast<size_t>(drawn));
  for (float& x : h) x = lo + (hi - lo) * rng.uniform();
  device::Buffer first = device::upload_values(h.data(), drawn, st);
  if (drawn == n) return first;
  const size_t esz = st == device::Storage::BF16 ? 2 : 4, total = size_t(n) * esz;
  device::Buffer all(total);
  device::copy(all.get(), first.get(), size_t(drawn) * esz);
  for (size_t have = size_t(drawn) * esz; have < total; have *= 2)  // doubling copies
    device::copy(all.as<char>() + have, all.get(), std::min(have, total - have));
  return all;
}

struct Row {
  std::string name, figure, ceiling, anchor;
};

class Report {
 public:
  void add(const std::string& key, Row r, double value) {
    rows_.push_back(std::move(r));
    json_[key] = value;
  }
  void print() const {
    std::printf("\n%-44s %-22s %-26s %s\n", "kernel", "k3", "vs ceiling", "vs anchor");
    for (const Row& r : rows_)
      std::printf("%-44s %-22s %-26s %s\n", r.name.c_str(), r.figure.c_str(), r.ceiling.c_str(), r.anchor.c_str());
  }
  nlohmann::json json_ = nlohmann::json::object();

 private:
  std::vector<Row> rows_;
};

std::string fmt(const char* f, double a) {
  char b[96];
  std::snprintf(b, sizeof b, f, a);
  return b;
}
std::string fmt2(const char* f, double a, double b2) {
  char b[128];
  std::snprintf(b, sizeof b, f, a, b2);
  return b;
}

}  // namespace

void run_kernels(const KernelArgs& args) {
  if (device::cuda_device_count() == 0)
    throw error("bench kernels", "times k3's CUDA kernels and needs an NVIDIA GPU; this machine has none usable (",
                kCpuBenchmarks, ")");
  std::printf("device: %s\n", device::describe());
  cuda::set_gemm_tuning(args.gemm_tuning);
  nlohmann::json fla = nlohmann::json::object();
  if (!args.versus.empty()) {
    std::ifstream in(args.versus);
    if (!in) throw error("bench kernels", "--versus ", args.versus, ": cannot open");
    try {
      fla = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw error("bench kernels", "--versus ", args.versus, ": not JSON (", e.what(), ")");
    }
  }
  auto anchor_of = [&](const std::string& key, double k3_ms, double fallback_ms, const char* who) {
    if (fla.contains(key) && fla[key].is_number()) {
      const double a = fla[key].get<double>();
      return fmt2("fla %.3f ms: %.2fx", a, a / k3_ms);
    }
    if (fallback_ms > 0) return fmt2((std::string(who) + " %.3f ms: %.2fx").c_str(), fallback_ms, fallback_ms / k3_ms);
    return std::string("-");
  };
  Report rep;
  Rng rng(1);
  double gemm_tf = 1.0;
  auto section = [&](const char* name) {
    return args.only.empty() || std::find(args.only.begin(), args.only.end(), name) != args.only.end();
  };
  const std::vector<int64_t> none;  // the loop range of a section left out

  // Ceilings: device-to-device copy (bytes read + written) and a bf16 GEMM.
  const size_t copy_bytes = size_t(2) << 30;
  device::Buffer a(copy_bytes), b(copy_bytes);
  device::zero(a.get(), copy_bytes);
  const double copy_ms = median_ms(args.reps, [&] { device::copy(b.get(), a.get(), copy_bytes); });
  const double copy_bw = 2.0 * double(copy_bytes) / (copy_ms * 1e-3);
  rep.add("copy_GBps", {"device copy 2 GiB (read + write)", fmt("%.0f GB/s", copy_bw / 1e9), "ceiling", "anchor ~4300 GB/s"},
          copy_bw / 1e9);
  {
    const int64_t n = 8192;
    device::Buffer A = random_values(rng, n * n, -1, 1, device::Storage::BF16);
    device::Buffer B = random_values(rng, n * n, -1, 1, device::Storage::BF16);
    device::Buffer C(size_t(n * n) * 4);
    const double ms = median_ms(std::max(3, args.reps / 4), [&] {
      cuda::gemm(cuda::Op::N, cuda::Op::N, n, n, n, 1.0f, A.get(), 0, B.get(), 0, 0.0f, C.as<float>(), 0,
                 device::Storage::BF16);
    });
    const double tf = 2.0 * double(n) * n * n / (ms * 1e-3) / 1e12;
    gemm_tf = tf;
    rep.add("gemm_bf16_TFLOPs", {"cuBLASLt bf16 GEMM 8192^3 (fp32 out)", fmt("%.0f TFLOP/s", tf), "ceiling",
                                 "anchor ~790 TFLOP/s"},
            tf);
  }

  // The delta rule family, prefill at B = 1: the chunked and the recurrent forward, and the
  // chunked forward + backward.
  struct Var {
    const char* name;
    linear::Write w;
    linear::Decay d;
    double anchor_fwd_ms;  // anchors.md §1.2 at T = 8192, H = 16 (fla); 0: none
  };
  const Var vars[] = {{"kda", linear::Write::Delta, linear::Decay::PerChannel, 0.62},
                      {"gdn", linear::Write::Delta, linear::Decay::Scalar, 0.0},
                      {"deltanet", linear::Write::Delta, linear::Decay::None, 0.0}};
  const int64_t K = 128, V = 128;
  // A prefill problem over packed sequences of the given lengths: bf16 q/k/v, fp32 β and decays,
  // and the DeviceArgs pointing at them; with_grads adds the backward's arrays (zeroed) and dO.
  struct DeltaProblem {
    device::Buffer q, k, v, beta, g, row0, len, o, ht, d_o, dq, dk, dv, dbeta, dg, dh0;
    linear::cuda::DeviceArgs da;
    linear::cuda::DeviceGrads gr;
    int64_t rows = 0;
  };
  auto delta_problem = [&](const Var& var, int64_t H, const std::vector<int64_t>& lens, bool with_grads) {
    DeltaProblem p;
    const int64_t N = int64_t(lens.size());
    std::vector<int64_t> r0;
    for (int64_t l : lens) r0.push_back(p.rows), p.rows += l;
    const int64_t rows = p.rows, gn = var.d == linear::Decay::PerChannel ? rows * H * K : rows * H;
    p.q = random_values(rng, rows * H * K, -0.09f, 0.09f, device::Storage::BF16);
    p.k = random_values(rng, rows * H * K, -0.09f, 0.09f, device::Storage::BF16);
    p.v = random_values(rng, rows * H * V, -1, 1, device::Storage::BF16);
    p.beta = random_values(rng, rows * H, 0, 1, device::Storage::F32);
    if (var.d != linear::Decay::None) p.g = random_values(rng, gn, -5, 0, device::Storage::F32);
    p.row0 = device::upload_new(r0.data(), r0.size() * 8), p.len = device::upload_new(lens.data(), lens.size() * 8);
    p.o = device::Buffer(size_t(rows * H * V) * 2), p.ht = device::Buffer(size_t(N * H * K * V) * 4);
    linear::cuda::DeviceArgs& da = p.da;
    da.N = N, da.H = H, da.HV = H, da.K = K, da.V = V, da.write = var.w, da.decay = var.d, da.io = DType::BF16;
    da.row0 = p.row0.as<int64_t>(), da.len = p.len.as<int64_t>();
    da.max_len = *std::max_element(lens.begin(), lens.end());
    da.q = p.q.get(), da.k = p.k.get(), da.v = p.v.get(), da.beta = p.beta.as<float>(), da.g = p.g.as<float>();
    da.o = p.o.get(), da.ht = p.ht.as<float>();
    if (with_grads) {
      p.dq = device::zeros_f32(rows * H * K), p.dk = device::zeros_f32(rows * H * K);
      p.dv = device::zeros_f32(rows * H * V), p.dbeta = device::zeros_f32(rows * H);
      p.dg = device::zeros_f32(std::max<int64_t>(gn, 1)), p.dh0 = device::zeros_f32(N * H * K * V);
      p.d_o = random_values(rng, rows * H * V, -1, 1, device::Storage::BF16);
      linear::cuda::DeviceGrads& gr = p.gr;
      gr.d_o = p.d_o.get(), gr.dq = p.dq.as<float>(), gr.dk = p.dk.as<float>(), gr.dv = p.dv.as<float>();
      gr.dbeta = p.dbeta.as<float>(), gr.dg = p.dg.as<float>(), gr.dh0 = p.dh0.as<float>(), gr.longest = da.max_len;
    }
    return p;
  };
  for (const Var& var : vars)
    for (int64_t H : section("prefill") ? args.heads : none)
      for (int64_t T : args.seq_lens) {
        DeltaProblem pb = delta_problem(var, H, {T}, T == args.seq_lens.front());
        linear::cuda::DeviceArgs& da = pb.da;
        const std::string key = std::string(var.name) + "_fwd_T" + std::to_string(T) + "_H" + std::to_string(H);
        // Both forward forms; the chunked one is what prefill uses (Form::Auto: on the tensor
        // cores, TF32), fla's figure is its. The chunked SIMT kernels are timed beside it.
        for (const int which : {0, 1, 2}) {
          const bool chunked = which < 2, simt = which == 1;
          da.form = chunked ? linear::cuda::Form::Chunked : linear::cuda::Form::Recurrent;
          da.simt = simt;
          const double ms = median_ms(std::max(3, args.reps / 4), [&] { linear::cuda::forward(da); });
          const double tps = double(T) / (ms * 1e-3);
          // Recurrent: decay+u, write, read, 3 multiply-adds per state element and token. Chunked
          // (C = 64): grams 2·C·K, W and U C·(K+V)/2, then W S, Qg S, Kdᵀ V_new (K·V each) and
          // Aqk V_new (C·V/2) per token, multiply-adds.
          const double C = 64;
          const double flops = chunked ? 2.0 * double(T) * H * (2 * C * K + C * (K + V) / 2 + 3 * K * V + C * V / 2)
                                       : 6.0 * double(T) * H * K * V;
          const char* form = which == 0 ? "_fwd_T" : which == 1 ? "_simt_fwd_T" : "_recurrent_fwd_T";
          const std::string k2 = std::string(var.name) + form + std::to_string(T) + "_H" + std::to_string(H);
          rep.add(k2 + "_ms",
                  {std::string(var.name) + (which == 0 ? " chunked" : which == 1 ? " chunked SIMT" : " recurrent") +
                       " fwd B1 T" + std::to_string(T) + " H" + std::to_string(H),
                   fmt2("%.2f ms %.2fM tok/s", ms, tps / 1e6),
                   fmt(which == 0 ? "%.2f TFLOP/s (TF32 tensor cores)" : "%.2f TFLOP/s (fp32 SIMT)", flops / (ms * 1e-3) / 1e12),
                   chunked ? anchor_of(key, ms, T == 8192 && H == 16 ? var.anchor_fwd_ms : 0.0, "anchors fla") : "-"},
                  ms);
        }
        da.form = linear::cuda::Form::Auto;
        da.simt = false;
        if (T == args.seq_lens.front()) {
          const linear::cuda::DeviceGrads& gr = pb.gr;
          // As in training: the forward keeps its scratch for the backward where it fits the budget.
          linear::cuda::ForwardScratch keep;
          size_t kept = 0;
          da.keep = &keep;
          const double bms = median_ms(3, [&] {
            linear::cuda::forward(da);
            kept = keep.bytes();
            linear::cuda::backward(da, gr);
          });
          da.keep = nullptr;
          const double rms = median_ms(3, [&] {  // memory-lean: the backward recomputes the forward's scratch
            linear::cuda::forward(da);
            linear::cuda::backward(da, gr);
          });
          rep.add(std::string(var.name) + "_fwdbwd_recompute_T" + std::to_string(T) + "_H" + std::to_string(H) + "_ms",
                  {std::string(var.name) + " chunked fwd+bwd T" + std::to_string(T) + " H" + std::to_string(H) +
                       " recomputing",
                   fmt("%.2f ms", rms), "nothing kept fwd->bwd", "-"},
                  rms);
          rep.add(std::string(var.name) + "_fwdbwd_T" + std::to_string(T) + "_H" + std::to_string(H) + "_ms",
                  {std::string(var.name) + " chunked fwd+bwd T" + std::to_string(T) + " H" + std::to_string(H),
                   fmt("%.2f ms", bms),
                   kept ? fmt("%.0f MB kept fwd->bwd", double(kept) / 1e6) : std::string("recomputed in bwd"),
                   anchor_of(std::string(var.name) + "_fwdbwd_T" + std::to_string(T) + "_H" + std::to_string(H), bms,
                             var.d == linear::Decay::PerChannel && T == 8192 && H == 16 ? 2.99 : 0.0, "anchors fla")},
                  bms);
        }
      }

  // A packed batch of unequal sequences (serving's prefill, training on documents): 16 sequences
  // of 64…1024 tokens, 8,704 in all, H 16, the chunked forward and forward + backward.
  // fla_bench.py --varlen times chunk_kda & co. on the same lengths through cu_seqlens.
  for (const Var& var : vars) {
    if (!section("varlen")) break;
    std::vector<int64_t> lens;
    for (int64_t i = 0; i < 16; ++i) lens.push_back(64 * (1 + (7 * i) % 16));
    DeltaProblem pb = delta_problem(var, 16, lens, true);
    linear::cuda::DeviceArgs& da = pb.da;
    const double ms = median_ms(std::max(3, args.reps / 4), [&] { linear::cuda::forward(da); });
    const std::string key = std::string(var.name) + "_varlen_fwd_H16";
    rep.add(key + "_ms",
            {std::string(var.name) + " chunked fwd, 16 packed seqs of 64-1024 (8704 tok) H16",
             fmt2("%.3f ms %.2fM tok/s", ms, double(pb.rows) / (ms * 1e-3) / 1e6), "-", anchor_of(key, ms, 0.0, "")},
            ms);
    linear::cuda::ForwardScratch keep;
    da.keep = &keep;
    const double bms = median_ms(3, [&] {
      linear::cuda::forward(da);
      linear::cuda::backward(da, pb.gr);
    });
    da.keep = nullptr;
    const std::string bkey = std::string(var.name) + "_varlen_fwdbwd_H16";
    rep.add(bkey + "_ms",
            {std::string(var.name) + " chunked fwd+bwd, the same packed batch", fmt("%.3f ms", bms), "-",
             anchor_of(bkey, bms, 0.0, "")},
            bms);
  }

  // Decode: one token per sequence, state read and written in place (fp32).
  for (const Var& var : vars)
    for (int64_t N : section("decode") ? args.decode_batches : none) {
      const int64_t H = 16;
      device::Buffer q = random_values(rng, N * H * K, -0.09f, 0.09f, device::Storage::BF16);
      device::Buffer k = random_values(rng, N * H * K, -0.09f, 0.09f, device::Storage::BF16);
      device::Buffer v = random_values(rng, N * H * V, -1, 1, device::Storage::BF16);
      device::Buffer beta = random_values(rng, N * H, 0, 1, device::Storage::F32);
      const int64_t gn = var.d == linear::Decay::PerChannel ? N * H * K : N * H;
      device::Buffer g = var.d == linear::Decay::None ? device::Buffer() : random_values(rng, gn, -1, 0, device::Storage::F32);
      device::Buffer S = random_values(rng, N * H * K * V, -0.1f, 0.1f, device::Storage::F32);
      std::vector<int64_t> r0(static_cast<size_t>(N)), ln(static_cast<size_t>(N), 1);
      for (int64_t i = 0; i < N; ++i) r0[size_t(i)] = i;
      device::Buffer row0 = device::upload_new(r0.data(), r0.size() * 8), len = device::upload_new(ln.data(), ln.size() * 8);
      device::Buffer o(size_t(N * H * V) * 2);
      linear::cuda::DeviceArgs da;
      da.N = N, da.H = H, da.HV = H, da.K = K, da.V = V, da.write = var.w, da.decay = var.d, da.io = DType::BF16;
      // The model's decode passes no row table (sequence n's token is row n); the any-T kernel
      // below needs one.
      da.len = len.as<int64_t>();
      da.q = q.get(), da.k = k.get(), da.v = v.get(), da.beta = beta.as<float>(), da.g = g.as<float>();
      da.h0 = S.as<float>(), da.o = o.get(), da.ht = S.as<float>(), da.max_len = 1;
      const double ms = median_ms(args.reps, [&] { linear::cuda::forward(da); });
      const double bytes = 2.0 * double(N) * H * K * V * 4;
      const double bw = bytes / (ms * 1e-3);
      const std::string key = std::string(var.name) + "_decode_N" + std::to_string(N);
      std::string anchor = "-";
      if (fla.contains(key + "_ms") && fla[key + "_ms"].is_number()) {
        const double a2 = fla[key + "_ms"].get<double>();
        anchor = fmt2("fla %.3f ms: %.2fx", a2, a2 / ms);
      } else if (var.d == linear::Decay::PerChannel) {
        anchor = fmt("anchors fla 3600 GB/s: %.2fx", bw / 3.6e12);
      }
      rep.add(key + "_ms",
              {std::string(var.name) + " decode step N" + std::to_string(N) + " H16 (fp32 state)",
               fmt2("%.3f ms %.0f GB/s", ms, bw / 1e9), fmt("%.0f%% of copy", 100.0 * bw / copy_bw), anchor},
              ms);
      if (var.d == linear::Decay::PerChannel) {
        // Variants of the same step, each a copy of its arguments, timed and reported alike.
        auto variant = [&](const linear::cuda::DeviceArgs& va, const std::string& suffix, const std::string& what) {
          const double vms = median_ms(args.reps, [&] { linear::cuda::forward(va); });
          rep.add(key + suffix,
                  {"kda step N" + std::to_string(N) + " " + what, fmt2("%.3f ms %.0f GB/s", vms, bytes / (vms * 1e-3) / 1e9),
                   fmt("%.0f%% of copy", 100.0 * bytes / (vms * 1e-3) / copy_bw), "-"},
                  vms);
        };
        linear::cuda::DeviceArgs ga = da;  // the general (any-T) kernel, which needs the row table
        ga.max_len = 0, ga.row0 = row0.as<int64_t>();
        variant(ga, "_general_ms", "through the any-T kernel");
        // The new state written to another buffer, as fla's figure does.
        device::Buffer S2(size_t(N * H * K * V) * 4);
        linear::cuda::DeviceArgs oa = da;
        oa.ht = S2.as<float>();
        variant(oa, "_out_of_place_ms", "into a new state buffer");
        // Each sequence's state where it lives, through a table of pointers (the model's decode).
        std::vector<float*> ptrs(static_cast<size_t>(N));
        for (int64_t i = 0; i < N; ++i) ptrs[size_t(i)] = S.as<float>() + i * H * K * V;
        device::Buffer table = device::upload_new(ptrs.data(), ptrs.size() * sizeof(float*));
        linear::cuda::DeviceArgs ta = da;
        ta.states = table.as<float* const>(), ta.h0 = nullptr, ta.ht = nullptr;
        variant(ta, "_states_ms", "through per-sequence state pointers");
        // The step from the layer's raw activations (what a KDA layer's decode hands the kernel):
        // q and k normalised, β from its logits and the decays from K3's lower-bound gate inside.
        device::Buffer A_log = random_values(rng, H, -1, 1, device::Storage::F32);
        device::Buffer dt_bias = random_values(rng, H * K, -1, 1, device::Storage::F32);
        linear::cuda::DeviceArgs fa = da;
        fa.prologue.l2norm = fa.prologue.beta_logit = true;
        fa.prologue.gate = linear::cuda::GateInput::LowerBound;
        fa.prologue.A_log = A_log.as<float>(), fa.prologue.dt_bias = dt_bias.as<float>();
        variant(fa, "_fused_ms", "from raw activations (norms, gates fused)");
      }
      // The same step as a decode loop: 32 steps captured in one CUDA graph, per-step time.
      constexpr int kSteps = 32;
      device::Graph graph;
      graph.begin();
      for (int i = 0; i < kSteps; ++i) linear::cuda::forward(da);
      graph.end();
      const double gms = median_ms(std::max(3, args.reps / 2), [&] { graph.replay(); }) / kSteps;
      const double gbw = bytes / (gms * 1e-3);
      rep.add(key + "_graph_ms",
              {std::string(var.name) + " decode N" + std::to_string(N) + ", 32-step CUDA graph",
               fmt2("%.3f ms %.0f GB/s", gms, gbw / 1e9), fmt("%.0f%% of copy", 100.0 * gbw / copy_bw), "-"},
              gms);
    }
  // Softmax attention: causal prefill (B = 1, 16 heads; hd 128, MLA's hd 192 / hdv 128, GPT-2's hd 64), bf16
  // storage (the tensor-core kernel), and a decode step over a KV cache. GPT-2 124M's training
  // shape (B 8, T 1024, 12 heads of 64) is timed too: short sequences, many of them.
  auto attention_case = [&](int64_t B, int64_t T, int64_t H, int64_t hd, int64_t hdv, const std::string& name,
                            const std::string& label) {
    device::Buffer q = random_values(rng, B * T * H * hd, -1, 1, device::Storage::BF16);
    device::Buffer k = random_values(rng, B * T * H * hd, -1, 1, device::Storage::BF16);
    device::Buffer v = random_values(rng, B * T * H * hdv, -1, 1, device::Storage::BF16);
    device::Buffer y(size_t(B * T * H * hdv) * 2), lse(size_t(B * T * H) * 4);
    const cuda::AttnShape shape{B, T, T, H, hd, hdv, 0, 1.0f / std::sqrt(float(hd))};
    const double ms = median_ms(std::max(3, args.reps / 2), [&] {
      cuda::attention_forward(q.get(), k.get(), v.get(), y.get(), lse.as<float>(), shape, device::Storage::BF16);
    });
    // Causal: half of the 2·T²·H·(hd + hdv) FLOPs of the two products.
    const double tf = double(B) * T * T * H * (hd + hdv) / (ms * 1e-3) / 1e12;
    const std::string key = "sdpa_fwd_" + name;
    std::string anchor = fmt2("anchors cuDNN %.0f TFLOP/s: %.2fx", 605.0, tf / 605.0);
    if (fla.contains(key) && fla[key].is_number())
      anchor = fmt2("torch SDPA %.3f ms: %.2fx", fla[key].get<double>(), fla[key].get<double>() / ms);
    rep.add(key + "_ms",
            {"softmax attention causal fwd " + label, fmt2("%.3f ms %.0f TFLOP/s", ms, tf),
             fmt("%.0f%% of GEMM", 100.0 * tf / gemm_tf), anchor},
            ms);
    if (hd != hdv) return;  // the backward's tensor-core kernel takes hd = hdv
    // Forward + backward (gradients into fp32 arrays, as training does): 2.5x the forward's FLOPs.
    device::Buffer dy = random_values(rng, B * T * H * hdv, -1, 1, device::Storage::BF16);
    device::Buffer dq(size_t(B * T * H * hd) * 4), dk(size_t(B * T * H * hd) * 4), dv(size_t(B * T * H * hdv) * 4);
    const double fb_ms = median_ms(std::max(3, args.reps / 2), [&] {
      cuda::attention_forward(q.get(), k.get(), v.get(), y.get(), lse.as<float>(), shape, device::Storage::BF16);
      device::zero(dq.get(), dq.bytes());  // dk and dv are written over, as training's step does
      cuda::attention_backward(q.get(), k.get(), v.get(), y.get(), lse.as<float>(), dy.get(), dq.as<float>(),
                               dk.as<float>(), dv.as<float>(), shape, device::Storage::BF16, /*accumulate_kv=*/false);
    });
    const double fb_tf = 3.5 * double(B) * T * T * H * (hd + hdv) / (fb_ms * 1e-3) / 1e12;
    const std::string fb_key = "sdpa_fwdbwd_" + name;
    std::string fb_anchor = "-";
    if (fla.contains(fb_key) && fla[fb_key].is_number())
      fb_anchor = fmt2("torch SDPA %.3f ms: %.2fx", fla[fb_key].get<double>(), fla[fb_key].get<double>() / fb_ms);
    rep.add(fb_key + "_ms",
            {"softmax attention causal fwd+bwd " + label, fmt2("%.3f ms %.0f TFLOP/s", fb_ms, fb_tf),
             fmt("%.0f%% of GEMM", 100.0 * fb_tf / gemm_tf), fb_anchor},
            fb_ms);
  };
  for (int64_t T : section("attention") ? args.seq_lens : none)
    for (const auto& [hd, hdv] : {std::pair<int64_t, int64_t>{128, 128}, {192, 128}, {64, 64}})
      attention_case(1, T, 16, hd, hdv,
                     "T" + std::to_string(T) + "_H16" + (hd != hdv ? "_hd192" : hd == 64 ? "_hd64" : ""),
                     "T" + std::to_string(T) + " H16 hd" + std::to_string(hd) +
                         (hd == hdv ? "" : "/" + std::to_string(hdv)));
  if (section("attention")) attention_case(8, 1024, 12, 64, 64, "gpt2", "B8 T1024 H12 hd64 (GPT-2 124M)");
  for (int64_t N : section("attention") ? args.decode_batches : none) {
    const int64_t H = 16, hd = 128, S = 4096;
    device::Buffer q = random_values(rng, N * H * hd, -1, 1, device::Storage::BF16);
    device::Buffer k = random_values(rng, N * S * H * hd, -1, 1, device::Storage::BF16);
    device::Buffer v = random_values(rng, N * S * H * hd, -1, 1, device::Storage::BF16);
    device::Buffer y(size_t(N * H * hd) * 2);
    const cuda::AttnShape shape{N, 1, S, H, hd, hd, S - 1, 1.0f / std::sqrt(float(hd))};
    const double ms = median_ms(std::max(3, args.reps / 2), [&] {
      cuda::attention_forward(q.get(), k.get(), v.get(), y.get(), nullptr, shape, device::Storage::BF16);
    });
    const double bw = double(N) * S * H * hd * 2 * 2 / (ms * 1e-3);
    rep.add("attn_decode_N" + std::to_string(N) + "_ms",
            {"softmax decode N" + std::to_string(N) + " ctx 4096 H16 (bf16 KV)", fmt2("%.3f ms %.0f GB/s", ms, bw / 1e9),
             fmt("%.0f%% of copy", 100.0 * bw / copy_bw), "-"},
            ms);
  }
  // MLA absorbed decode: one token per sequence over an fp32 and a bf16 latent cache, DeepSeek-V3/K3
  // latent shape (kv_lora 512 + rope 64, 16 heads here), k3-small's (96 + 32, 6 heads) and a
  // narrower one (48 + 16, 6 heads) at 128K. The roofline is the cache's bytes at the copy rate.
  struct LatentCase {
    const char* name;
    int64_t H, R, rope, S;
  };
  cuda::set_latent_kernel(args.mla_kernel == "wgmma" ? cuda::LatentKernel::Warpgroup
                          : args.mla_kernel == "mma" ? cuda::LatentKernel::MmaSync
                                                     : cuda::LatentKernel::Auto);
  std::vector<device::Storage> caches;
  for (const std::string& d : args.cache_dtypes)
    caches.push_back(d == "bf16" ? device::Storage::BF16 : device::Storage::F32);
  for (const device::Storage st : caches)
    for (const LatentCase& lc : {LatentCase{"mla576 H16 ctx4096", 16, 512, 64, 4096},
                                 LatentCase{"mla128 H6 ctx128K (k3-small)", 6, 96, 32, 131072},
                                 LatentCase{"mla64 H6 ctx128K", 6, 48, 16, 131072}})
      for (int64_t N : section("mla") ? args.decode_batches : none) {
        const bool bf16 = st == device::Storage::BF16;
        const int64_t W = lc.R + lc.rope, esz = bf16 ? 2 : 4;
        if (double(N) * lc.S * W * esz > 40e9) continue;
        device::Buffer qt = random_values(rng, N * lc.H * W, -1, 1, device::Storage::F32);
        device::Buffer lat = random_values(rng, N * lc.S * W, -1, 1, st);
        device::Buffer ob(size_t(N * lc.H * lc.R) * 4);
        std::vector<const void*> lats;
        std::vector<int64_t> p0(static_cast<size_t>(N), lc.S - 1);
        for (int64_t i = 0; i < N; ++i) lats.push_back(lat.as<char>() + i * lc.S * W * esz);
        device::Buffer d_lats = device::upload_new(lats.data(), lats.size() * sizeof(void*));
        device::Buffer d_p0 = device::upload_new(p0.data(), p0.size() * 8);
        const double ms = median_ms(std::max(3, args.reps / 2), [&] {
          cuda::latent_attention(qt.as<float>(), d_lats.as<const void*>(), st, d_p0.as<int64_t>(), lc.S, ob.as<float>(),
                                 N, 1, lc.H, W, lc.R, 0.05f);
        });
        const double bw = double(N) * lc.S * W * esz / (ms * 1e-3);
        // A forced kernel (--mla-kernel) names itself in the key and the label.
        const std::string forced = bf16 && W == 576 && args.mla_kernel != "auto" ? args.mla_kernel : "";
        rep.add("mla_decode_" + std::string(bf16 ? "bf16_" : "") + (forced.empty() ? "" : forced + "_") +
                    std::to_string(W) + "_N" + std::to_string(N) + "_ms",
                {std::string("MLA absorbed decode N") + std::to_string(N) + " " + lc.name +
                     (bf16 ? " (bf16 latent)" : " (fp32 latent)") + (forced.empty() ? "" : " [" + forced + "]"),
                 fmt2("%.3f ms %.0f GB/s", ms, bw / 1e9), fmt("%.0f%% of copy", 100.0 * bw / copy_bw),
                 "target 80% of copy"},
                ms);
      }
  // The decode step's small GEMMs (k3-small's shapes at batch 64, bf16 operands): gemm_nt_grouped
  // against one library GEMM per problem, each call alone and 50 calls in one CUDA graph (the
  // device's own time per call, without the host's launches). The roofline is the operands'
  // bytes at the copy rate; at these sizes a call costs what its launch and latency cost.
  struct SmallCase {
    const char* name;
    int64_t M, K;
    std::vector<int64_t> Ns;
  };
  const std::vector<SmallCase> small = {
      {"1 problem 64x384, K 384", 64, 384, {384}},
      {"1 problem 1x384, K 384", 1, 384, {384}},
      {"1 problem 64x384, K 64", 64, 64, {384}},
      {"1 problem 64x384, K 1536", 64, 1536, {384}},
      {"1 problem 64x384, K 4096", 64, 4096, {384}},
      {"6 problems 64x{384x5, 6}, K 384", 64, 384, {384, 384, 384, 384, 384, 6}},
      {"16 problems 64x512, K 384 (MoE)", 64, 384, std::vector<int64_t>(16, 512)},
      {"16 problems 64x384, K 256 (MoE)", 64, 256, std::vector<int64_t>(16, 384)},
      {"1 problem 64x8192, K 384 (head)", 64, 384, {8192}},
  };
  if (section("small-gemm")) {
    constexpr int kCalls = 50;
    device::Buffer tiny(4);
    device::Graph zg;
    zg.begin();
    for (int i = 0; i < kCalls; ++i) device::zero(tiny.get(), 4);
    zg.end();
    const double zus = median_ms(args.reps, [&] { zg.replay(); }) * 1e3 / kCalls;
    rep.add("graph_node_us", {"4-byte memset in a CUDA graph (floor)", fmt("%.2f us per node", zus), "-", "-"}, zus);
    for (const SmallCase& sc : small) {
      int64_t wrows = 0;
      for (int64_t n : sc.Ns) wrows += n;
      device::Buffer A = random_values(rng, sc.M * sc.K, -1, 1, device::Storage::BF16);
      device::Buffer W = random_values(rng, wrows * sc.K, -1, 1, device::Storage::BF16);
      device::Buffer C(size_t(sc.M * wrows) * 4);
      std::vector<cuda::GemmProblem> ps;
      int64_t off = 0;
      for (int64_t n : sc.Ns) {
        ps.push_back({sc.M, A.get(), W.as<uint16_t>() + off * sc.K, C.as<float>() + sc.M * off, n});
        off += n;
      }
      auto grouped = [&] { cuda::gemm_nt_grouped(0, sc.K, ps, device::Storage::BF16); };
      auto library = [&] {
        for (const cuda::GemmProblem& p : ps)
          cuda::gemm(cuda::Op::N, cuda::Op::T, p.M, p.N, sc.K, 1.0f, p.A, sc.K, p.B, sc.K, 0.0f, p.C, p.N,
                     device::Storage::BF16);
      };
      auto per_call = [&](auto&& f, bool graphed) {
        if (!graphed)
          return median_ms(args.reps, [&] {
                   for (int i = 0; i < kCalls; ++i) f();
                 }) * 1e3 / kCalls;
        device::Graph g;
        g.begin();
        for (int i = 0; i < kCalls; ++i) f();
        g.end();
        return median_ms(args.reps, [&] { g.replay(); }) * 1e3 / kCalls;
      };
      const double bytes = double(wrows * sc.K + sc.M * sc.K) * 2 + double(sc.M * wrows) * 4;
      const double gus = per_call(grouped, false), ggus = per_call(grouped, true);
      const double lus = per_call(library, false), lgus = per_call(library, true);
      const std::string key = std::string("small_gemm_") + std::to_string(ps.size()) + "x" + std::to_string(sc.M) + "x" +
                              std::to_string(sc.Ns[0]) + "_K" + std::to_string(sc.K);
      rep.add(key + "_us",
              {std::string("grouped GEMM ") + sc.name, fmt2("%.1f us (graph %.1f)", gus, ggus),
               fmt("roofline %.2f us", bytes / copy_bw * 1e6),
               fmt2("cuBLAS per problem %.1f us (graph %.1f)", lus, lgus)},
              ggus);
    }
  }
  // GPT-2 124M training on the GPU (fp32 weights and GEMMs, no TF32), one step of B × 1024 tokens.
  if (args.train_batch > 0 && section("gpt2")) {
    auto model = build_model(preset_config("gpt2"), "gpt2");
    model->init_random(1);
    const auto* gpt2 = dynamic_cast<const Gpt2Model*>(model.get());
    cuda::Gpt2Runner run(*gpt2, device::Storage::F32);
    const int64_t B = args.train_batch, T = 1024;
    std::vector<int64_t> ids(static_cast<size_t>(B * T)), tg(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(rng.uniform() * 50000) % 50257;
    for (size_t i = 0; i < ids.size(); ++i) tg[i] = (i + 1) % size_t(T) ? ids[i + 1] : -1;
    const double flops = 6.0 * double(model->total_params()) * B * T + 12.0 * 12 * 768 * double(T) * B * T / 2;
    // llm.c's tokens/s at this batch from --versus (key llmc_train_B<B>_tok_s, timed beside k3 in
    // the same session), else its best figure at B 8 or 16 measured by hand on H200s: the
    // cuDNN-attention build, 452-472K tok/s at B 8, 489-524K at B 16 (the default build without
    // cuDNN: 331-333K at B 8).
    auto llmc_versus = [&](int64_t batch, double tps) {
      const std::string key = "llmc_train_B" + std::to_string(batch) + "_tok_s";
      if (fla.contains(key) && fla[key].is_number()) {
        const double llmc = fla[key].get<double>();
        return fmt2(("llm.c B" + std::to_string(batch) + " same session %.0fK tok/s: %.3fx").c_str(), llmc / 1e3,
                    tps / llmc);
      }
      if (batch != 8 && batch != 16) return std::string("llm.c: no figure at this batch (--versus)");
      const double llmc = batch == 8 ? 472e3 : 524e3;
      return fmt2(("llm.c B" + std::to_string(batch) + " cuDNN build on an H200 (by hand) %.0fK tok/s: %.3fx").c_str(),
                  llmc / 1e3, tps / llmc);
    };
    for (const bool bf16 : {true, false}) {  // bf16 GEMM and attention operands (fp32 accumulation), then fp32
      run.set_bf16_gemms(bf16);
      const double ms = median_ms(3, [&] { run.train_step(ids.data(), tg.data(), B, T, 1e-4f, {}); });
      const double tps = double(B * T) / (ms * 1e-3);
      rep.add(bf16 ? "gpt2_train_bf16_tok_s" : "gpt2_train_tok_s",
              {"gpt2 124M train step B" + std::to_string(B) + " T1024 (" + (bf16 ? "bf16 GEMMs+attn" : "fp32") + ")",
               fmt2("%.0f ms %.0fK tok/s", ms, tps / 1e3),
               fmt("%.1f%% MFU of the bf16 rate", 100.0 * flops / (ms * 1e-3) / (gemm_tf * 1e12)),
               llmc_versus(B, tps)},
              tps);
    }
  }
  rep.print();
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    out << rep.json_.dump(2) << "\n";
    if (!out) throw error("bench kernels", "--json ", args.json, ": cannot write");
    std::printf("\nwrote %s\n", args.json.c_str());
  }
}
#else
}  // namespace

void run_kernels(const KernelArgs&) {
  throw error("bench kernels", "times k3's CUDA kernels: this k3 was built without the CUDA backend (configure with ",
              "-DK3_CUDA=ON where the CUDA toolkit is installed; ", kCpuBenchmarks, ")");
}
#endif

}  // namespace k3::bench
