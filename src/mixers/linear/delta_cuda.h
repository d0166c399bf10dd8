// The delta-rule kernels of delta_cuda.cu on device buffers, for callers that keep their tensors
// on the GPU (benchmarks; the model-level CUDA path). Queued on k3's stream (core/device.h).
// Layouts as in delta_core.h; row0/len [N] give each sequence's first token row and length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/dtype.h"
#include "mixers/linear/delta_core.h"

namespace k3::linear::cuda {

// Which kernels run: Auto takes the chunked form when the longest sequence (max_len, or the
// backward's `longest`) is known and longer than one 64-token chunk, the decode kernel when it
// is 1, else the recurrent one.
enum class Form : uint8_t { Auto, Recurrent, Chunked };

// The chunked forward's scratch (its operands, each chunk's entering state, T and Ā) kept from a
// forward to the backward that follows, so that the backward does not recompute them (training).
// A forward given one (DeviceArgs::keep) fills it when that scratch, for every chunk at once,
// fits `budget` bytes, else leaves it empty; the backward uses it when it was filled for the same
// arguments, and empties it either way (its products overwrite the scratch). Costs bytes() of
// device memory from the forward to the backward (about 5 KiB per token and value head at
// K = V = 128).
struct ChunkSaved;
struct ForwardScratch {
  ForwardScratch();
  ~ForwardScratch();
  ForwardScratch(ForwardScratch&&) noexcept;
  ForwardScratch& operator=(ForwardScratch&&) noexcept;
  bool filled() const { return bool(saved); }
  size_t bytes() const;
  std::unique_ptr<ChunkSaved> saved;  // delta_chunked_cuda.cu's
  size_t budget = size_t(4) << 30;    // the most the forward may keep
  int64_t reused = 0;                 // backwards that skipped their recompute through it
};

// What the decode kernel computes from a layer's raw activations: q/‖q‖ and k/‖k‖ over K (eps
// inside the root, as ag::l2norm), β = σ(beta), and g from the gate's pre-activations (beta and g
// then hold those) by the KDA gate forms (ops/gates.h): Softplus g = −exp(A_log[hv]) ·
// softplus(x + dt_bias), LowerBound g = lb · σ(exp(A_log[hv]) · (x + dt_bias)); dt_bias [HV, K]
// per channel, [HV] for a scalar decay.
enum class GateInput : uint8_t { LogDecay, Softplus, LowerBound };
struct DecodePrologue {
  bool l2norm = false;
  float l2_eps = 1e-6f;
  bool beta_logit = false;
  GateInput gate = GateInput::LogDecay;
  const float* A_log = nullptr;    // [≥ HV]
  const float* dt_bias = nullptr;  // [HV, K] or [HV]
  float lower_bound = -5.0f;
  bool active() const { return l2norm || beta_logit || gate != GateInput::LogDecay; }
};

struct DeviceArgs {
  Form form = Form::Auto;
  int64_t N = 0, H = 0, HV = 0, K = 0, V = 0;
  Write write = Write::Delta;
  Decay decay = Decay::None;
  float scale = 0.0f;                       // 0: K^-1/2
  DType io = DType::F32;                    // storage of q, k, v: F32 or BF16
  DType o_dtype = DType::BF16;              // storage of o when io is BF16 (F32 keeps it fp32)
  const int64_t* row0 = nullptr;            // [N]
  const int64_t* len = nullptr;             // [N]
  int64_t max_len = 0;                      // longest sequence if known (1 picks the decode kernel)
  int64_t window = 0;                       // chunked form: chunks per scratch window (0: as 1 GiB allows)
  bool simt = false;                        // chunked form: SIMT kernels even where the tensor-core ones apply
  ForwardScratch* keep = nullptr;           // chunked form: the forward's scratch for the backward, or null
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  const float* beta = nullptr;              // [rows, HV] (Delta)
  const float* g = nullptr;                 // [rows, HV] or [rows, HV, K]
  const float* h0 = nullptr;                // [N, HV, K, V] or null
  void* o = nullptr;                        // [rows, HV, V]
  float* ht = nullptr;                      // [N, HV, K, V] or null (may equal h0: in-place decode)
  // Decode step only (max_len 1): N device pointers, each to one sequence's [HV, K, V] state,
  // read and written in place (h0 and ht unused); with row0 null, sequence n's token is row n.
  // Each 16-byte aligned where V % 4 == 0 (device allocations are 256-byte aligned).
  float* const* states = nullptr;
  // Decode step only: the layer's activations in the kernel, so that a delta layer's step is one
  // launch after its projections and convolutions. Off by default (q, k, β and g as given).
  DecodePrologue prologue;
};

struct DeviceGrads {
  const void* d_o = nullptr;  // or null; bf16 when io and do_dtype are BF16, else fp32
  DType do_dtype = DType::BF16;
  const float* dht = nullptr;
  float *dq = nullptr, *dk = nullptr, *dv = nullptr, *dbeta = nullptr, *dg = nullptr, *dh0 = nullptr;  // zeroed
  int64_t longest = 0;        // longest sequence (sizes the recompute scratch)
};

// DeviceArgs for one layer's options and head sizes, fp32 storage (the model-level callers);
// the sequences, pointers and states are the caller's.
inline DeviceArgs fp32_args(const DeltaOptions& o, int64_t H, int64_t HV, int64_t K, int64_t V) {
  DeviceArgs a;
  a.H = H;
  a.HV = HV;
  a.K = K;
  a.V = V;
  a.write = o.write;
  a.decay = o.decay;
  a.scale = o.scale;
  a.io = DType::F32;
  a.o_dtype = DType::F32;
  return a;
}

// Checks the sizes the kernels support (K ≤ 128, V ≤ 160), throws k3::Error otherwise.
void check_supported(int64_t K, int64_t V);
void forward(const DeviceArgs& a);
// delta_chunked_cuda.cu: the chunked form (needs max_len). forward() and backward() call it as
// `form` says (Auto: sequences longer than one chunk).
void chunked_forward(const DeviceArgs& a);
void chunked_backward(const DeviceArgs& a, const DeviceGrads& g);
void backward(const DeviceArgs& a, const DeviceGrads& g);

}  // namespace k3::linear::cuda
