// The delta-rule family on CUDA, chunked form (README.md beside this file, "Chunked form"): the
// same math as delta_chunked.cc, split into kernels so that only the state recurrence (and its
// adjoint) is sequential. This file is the host side (scratch, windows, the launches' order);
// each stage's kernels are a file of their own around delta_chunked_cuda.cuh.
//
// 1. `prepare` — one block per (chunk, sequence, value head), all chunks at once. In shared
//    memory: the chunk's q (scaled), k, β and the cumulative log-decays G (summed in double, kept
//    in log₂ units); the decayed grams Ā = tril(K Kᵀ ⊙ e^{G_r−G_s}) and Aqk (with the diagonal) in
//    4 × 4 register tiles, every exponent ≤ 0 so extreme decays stay finite: on a diagonal tile
//    each pair's own G_r − G_s (r ≥ s), off it the two factors e^{G_r−G_ref} e^{G_ref−G_s} with
//    G_ref the tile's last column; T = (I + diag(β) Ā)⁻¹ by blocked inversion (a warp per 16-row
//    diagonal block, then the blocks below by their distance to the diagonal; the tensor-core form:
//    a thread per column of the diagonal blocks, then 32-row halves and the whole by 3xTF32
//    products); then to global scratch
//      W = T diag(β) (e^G ⊙ K), U = T diag(β) V (Additive: U = V), Aqk,
//      Qg = e^G ⊙ (s Q), Kd = e^{G_C − G} ⊙ K, and e^{G_C}.
// 2. `recur` — one block per (sequence, value head, tile of kVb = 16 value columns) walks the chunks in
//    order with its state slice S [K, kVb] in shared memory, storing each chunk's entering S₀ and
//      V_new = U − W S₀,  then S ← diag(e^{G_C}) S₀ + Kdᵀ V_new;
//    its operands arrive by cp.async one phase ahead of their use.
// 3. `output` — one block per (chunk, sequence, value head, tile of 64 columns), all at once, 4 × 4
//    register tiles: O = Qg S₀ + Aqk V_new.
// Rows past a sequence's end are zero (k, q, v, β, g), so a partial last chunk needs no special
// case: its padded rows write nothing into the state and their outputs are not stored.
//
// Backward (README.md, "Chunked" under "Backward"): prepare and recur again, then `reverse` — per
// (sequence, value head, column tile), chunks in reverse, carries the state adjoint dS:
//      dV_new = Kd dS + Aqkᵀ dO,  dS ← diag(e^{G_C}) dS + Qgᵀ dO − Wᵀ dV_new,
// storing dS (the adjoint of each chunk's leaving state) and dV_new (operands by cp.async, one
// phase ahead); `grads` — one block per
// (chunk, sequence, value head), all at once: everything else of the README's chunk backward
// (dKd, dQg, dW, dT, dA = −Tᵀ dT Tᵀ, the decayed grams' backward with every exponent ≤ 0 as in the
// forward — per pair inside a 16-row block, split at the block's edges across blocks — dβ, and dg
// as the reverse cumulative sum of dG inside the chunk).
//
// The scratch holds a window of chunks per (sequence, head); longer inputs run window after window,
// the state passing between them through `ht` (or a temporary), so memory stays bounded (the
// backward keeps every window's entering state and recomputes the window before its reverse).
// q/k/v/o in fp32 or bf16 storage as in the recurrent kernels. fp32 storage: fp32 SIMT arithmetic
// throughout. bf16 storage (K a multiple of 16): prepare, recur, output and reverse take their
// products on the tensor cores as TF32 (the `tc` kernels below, README.md "On the GPU"); grads
// its products over V, the rest of it SIMT. With a scalar gate or none (Gated DeltaNet, DeltaNet)
// prepare's grams are plain bf16 products of q and k on the tensor cores, scaled per entry.
#include <memory>
#include <optional>

#include "mixers/linear/delta_chunked_cuda.cuh"

namespace k3::linear::detail {
namespace {

enum class Step : uint8_t { Prepare, Recur, Output, Reverse, Grads };

void run(Step step, const ChunkDev& d, int64_t NHV, DType io) {
  switch (step) {
    case Step::Prepare: launch_prepare(d, NHV, io); break;
    case Step::Recur: launch_recur(d, NHV); break;
    case Step::Output: launch_output(d, NHV, io); break;
    case Step::Reverse: launch_reverse(d, NHV); break;
    case Step::Grads: launch_grads(d, NHV, io); break;
  }
}

// The scratch of one window: the slabs and chunk states, and for the backward the states'
// adjoints and dV_new.
struct Scratch {
  device::Buffer W, Qg, Kd, U, Aqk, gC, Sc, dSc, dVn, TA;
  Scratch(ChunkDev& d, int64_t NHV, int64_t window, bool backward) {
    const int64_t rows = NHV * window * kC;
    auto f32 = [](int64_t n) { return device::Buffer(size_t(n) * sizeof(float)); };
    W = f32(rows * d.KS), Qg = f32(rows * d.KS), Kd = f32(rows * d.KS), U = f32(rows * d.V);
    Aqk = f32(rows * kC), gC = f32(NHV * window * d.KS);
    d.W = W.as<float>(), d.Qg = Qg.as<float>(), d.Kd = Kd.as<float>(), d.U = U.as<float>();
    d.Aqk = Aqk.as<float>(), d.gC = gC.as<float>();
    Sc = f32(NHV * window * d.K * d.V);
    d.Sc = Sc.as<float>();
    if (backward) {
      dSc = f32(NHV * window * d.K * d.V), dVn = f32(rows * d.V), TA = f32(rows * kC);
      d.dSc = dSc.as<float>(), d.dVn = dVn.as<float>(), d.TA = TA.as<float>();
    }
  }
};

ChunkDev chunk_dev(const cuda::DeviceArgs& a) {
  cuda::check_supported(a.K, a.V);
  if (a.max_len < 1) throw error("delta", "the chunked CUDA kernels need the longest sequence length (max_len)");
  ChunkDev d{};
  d.N = int(a.N), d.H = int(a.H), d.HV = int(a.HV), d.K = int(a.K), d.V = int(a.V), d.group = int(a.HV / a.H);
  d.delta_write = a.write == Write::Delta;
  d.decay = a.decay == Decay::None ? 0 : a.decay == Decay::Scalar ? 1 : 2;
  d.scale = a.scale > 0.0f ? a.scale : 1.0f / sqrtf(float(a.K));
  d.row0 = a.row0, d.len = a.len;
  d.q = a.q, d.k = a.k, d.v = a.v, d.beta = a.beta, d.g = a.g;
  d.o_f32 = a.io != DType::BF16 || a.o_dtype != DType::BF16;
  d.KS = int((a.K + 3) / 4 * 4);
  // The tensor-core kernels load q, k and v 16 bytes at a time.
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  d.tc = a.io == DType::BF16 && a.K % 16 == 0 && a.K <= 128 && !a.simt && aligned(a.q) && aligned(a.k) && aligned(a.v);
  return d;
}

// Chunks per window: as many as the scratch budget holds (a.window overrides).
int64_t window_of(const cuda::DeviceArgs& a, const ChunkDev& d, int64_t chunks, bool backward) {
  const int64_t NHV = a.N * a.HV;
  int64_t per_chunk = kC * (3 * d.KS + a.V + kC) + d.KS + a.K * a.V;
  if (backward) per_chunk += a.K * a.V + kC * (a.V + kC);
  per_chunk *= int64_t(sizeof(float)) * NHV;
  // The chunk index of a window is gridDim.y of the per-chunk kernels (≤ 65,535).
  return std::clamp<int64_t>(a.window > 0 ? a.window : kScratchBudget / per_chunk, 1, std::min<int64_t>(chunks, 65535));
}

}  // namespace
}  // namespace k3::linear::detail

namespace k3::linear::cuda {

// A whole sequence's scratch in one window, filled by the forward with what the backward reads
// (T and Ā, each chunk's entering state, V_new), and the arguments it was filled for.
struct ChunkSaved {
  detail::Scratch scratch;
  detail::ChunkDev d;  // the scratch's pointers (set by its constructor)
  DeviceArgs args;     // what the forward ran on (keep cleared)
  int64_t chunks;
  size_t bytes;
  ChunkSaved(detail::ChunkDev& dev, int64_t NHV, int64_t chunks_, size_t bytes_, const DeviceArgs& a)
      : scratch(dev, NHV, chunks_, true), d(dev), args(a), chunks(chunks_), bytes(bytes_) {
    args.keep = nullptr;
  }
  bool matches(const DeviceArgs& a) const {
    const DeviceArgs& b = args;
    return a.N == b.N && a.H == b.H && a.HV == b.HV && a.K == b.K && a.V == b.V && a.write == b.write &&
           a.decay == b.decay && a.scale == b.scale && a.io == b.io && a.row0 == b.row0 && a.len == b.len &&
           a.max_len == b.max_len && a.simt == b.simt && a.q == b.q && a.k == b.k && a.v == b.v &&
           a.beta == b.beta && a.g == b.g && a.h0 == b.h0;
  }
};

ForwardScratch::ForwardScratch() = default;
ForwardScratch::~ForwardScratch() = default;
ForwardScratch::ForwardScratch(ForwardScratch&&) noexcept = default;
ForwardScratch& ForwardScratch::operator=(ForwardScratch&&) noexcept = default;
size_t ForwardScratch::bytes() const { return saved ? saved->bytes : 0; }

void chunked_forward(const DeviceArgs& a) {
  using namespace detail;
  ChunkDev d = chunk_dev(a);
  const int64_t NHV = a.N * a.HV;
  if (NHV == 0) return;
  d.o = a.o;
  d.store_vn = 1;
  const int64_t chunks = (a.max_len + kC - 1) / kC;
  // The backward's scratch for every chunk in one window (window_of's per-chunk sizes).
  const size_t keep_bytes = sizeof(float) * size_t(NHV * chunks * kC * (3 * d.KS + 2 * a.V + 2 * kC) +
                                                   NHV * chunks * (d.KS + 2 * a.K * a.V));
  if (a.keep) a.keep->saved.reset();
  // Kept for the backward: one window of the backward's scratch over every chunk; else windows
  // of the forward's own.
  std::unique_ptr<ChunkSaved> saved;
  std::optional<Scratch> scratch;
  int64_t window = chunks;
  if (a.keep && keep_bytes <= a.keep->budget && chunks <= 65535 && (a.window == 0 || a.window >= chunks)) {
    saved = std::make_unique<ChunkSaved>(d, NHV, chunks, keep_bytes, a);
  } else {
    window = window_of(a, d, chunks, false);
    scratch.emplace(d, NHV, window, false);
  }
  // The state between windows: ht when the caller wants it (it may alias h0: each block reads its
  // slice before writing it), else a temporary.
  device::Buffer tmp;
  float* state = a.ht;
  if (!state) {
    tmp = device::Buffer(size_t(NHV * a.K * a.V * 4));
    state = tmp.as<float>();
  }
  for (int64_t cb = 0; cb < chunks; cb += window) {
    d.c_begin = int(cb);
    d.c_count = int(std::min(window, chunks - cb));
    d.s_in = cb == 0 ? a.h0 : state;
    d.s_out = state;
    run(Step::Prepare, d, NHV, a.io);
    run(Step::Recur, d, NHV, a.io);
    run(Step::Output, d, NHV, a.io);
  }
  if (saved) a.keep->saved = std::move(saved);
  // The scratch returns to the allocator's cache; later work on the same stream cannot overlap.
}

void chunked_backward(const DeviceArgs& a, const DeviceGrads& g) {
  using namespace detail;
  ChunkDev d = chunk_dev(a);
  const int64_t NHV = a.N * a.HV;
  if (NHV == 0) return;
  const int64_t chunks = (a.max_len + kC - 1) / kC;
  std::unique_ptr<ChunkSaved> saved;
  if (a.keep) saved = std::move(a.keep->saved);  // emptied either way
  if (saved && (!saved->matches(a) || saved->chunks != chunks)) saved.reset();
  if (saved) ++a.keep->reused;
  const int64_t window = saved ? chunks : window_of(a, d, chunks, true);
  const int64_t windows = (chunks + window - 1) / window;
  const size_t state_bytes = size_t(NHV * a.K * a.V) * sizeof(float);
  std::optional<Scratch> scratch;
  if (saved)
    d = saved->d;  // the forward's scratch: window 0 of 1 needs no recompute
  else
    scratch.emplace(d, NHV, window, true);
  // The state entering each window after the first (one forward sweep, no outputs).
  device::Buffer starts(state_bytes * size_t(std::max<int64_t>(windows - 1, 0)));
  auto start_of = [&](int64_t w) { return w == 0 ? a.h0 : starts.as<float>() + (w - 1) * NHV * a.K * a.V; };
  ChunkDev f = d;
  f.Sc = nullptr, f.dSc = nullptr, f.dVn = nullptr, f.TA = nullptr;
  for (int64_t w = 0; w + 1 < windows; ++w) {
    f.c_begin = int(w * window), f.c_count = int(window);
    f.s_in = start_of(w), f.s_out = starts.as<float>() + w * NHV * a.K * a.V;
    run(Step::Prepare, f, NHV, a.io);
    run(Step::Recur, f, NHV, a.io);
  }
  device::Buffer state(state_bytes), carry_a(state_bytes), carry_b(state_bytes), dh0_tmp;
  float* dh0 = g.dh0;
  if (!dh0) {
    dh0_tmp = device::Buffer(state_bytes);
    dh0 = dh0_tmp.as<float>();
  }
  d.store_vn = 1;
  d.o = nullptr;
  d.d_o = g.d_o;
  d.do_f32 = a.io != DType::BF16 || g.do_dtype != DType::BF16;
  d.dq = g.dq, d.dk = g.dk, d.dv = g.dv, d.dbeta = g.dbeta, d.dg = g.dg;
  const float* ds_in = g.dht;
  for (int64_t w = windows - 1; w >= 0; --w) {
    d.c_begin = int(w * window);
    d.c_count = int(std::min(window, chunks - w * window));
    d.s_in = start_of(w), d.s_out = state.as<float>();
    if (!saved) {
      run(Step::Prepare, d, NHV, a.io);
      run(Step::Recur, d, NHV, a.io);
    }
    d.ds_in = ds_in;
    d.ds_out = w == 0 ? dh0 : ((windows - 1 - w) % 2 ? carry_b.as<float>() : carry_a.as<float>());
    run(Step::Reverse, d, NHV, a.io);
    run(Step::Grads, d, NHV, a.io);
    ds_in = d.ds_out;
  }
}

}  // namespace k3::linear::cuda
