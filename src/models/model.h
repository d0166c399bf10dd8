// Model: the interface every architecture implements (one file per architecture, one line in
// registry.cc). A model maps token ids to final hidden states through differentiable ops
// (ops/ag.h), so the same forward serves inference, decode (with per-sequence Contexts, the
// lists of Memory objects) and training (under ag Recording, then backward).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blocks/stack.h"
#include "core/device.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "mixers/memory.h"
#include "mixers/mixer.h"
#include "ops/param.h"

namespace k3 {

class MtpHead;

enum class Logits : uint8_t { All, Last };

// Whether loading keeps a checkpoint's block-format weights packed (LoadPlan::packed).
enum class PackedWeights : uint8_t { Inflate, Keep };

// B sequences of T tokens (ids row-major [B, T]). With contexts (B of them) the tokens continue
// those sequences; without, each sequence starts at position 0.
struct TokenBatch {
  const int64_t* ids = nullptr;
  int64_t B = 1, T = 0;
  Context* const* contexts = nullptr;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string architecture() const = 0;  // the config's model_type
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;
  virtual int64_t num_layers() const = 0;
  virtual void visit(const ParamVisitor& v) const = 0;
  virtual Json config_json() const = 0;
  virtual std::vector<LayerMemory> memory_layers() const = 0;
  virtual Context new_context(int64_t max_tokens) const = 0;
  // Final normalised hidden states [B*T, D]; advances the contexts' positions.
  virtual Var hidden(const TokenBatch& batch) const = 0;
  virtual Var head_weight() const = 0;  // [V, D]: logits = hidden · headᵀ
  // The checkpoint's multi-token-prediction head (models/mtp.h), where it has one.
  virtual const MtpHead* mtp() const { return nullptr; }
  // Fresh random weights (the architecture's own init).
  virtual void init_random(uint64_t seed) = 0;
  // Parameters touched per token. Default: all but embedding lookups.
  virtual int64_t active_params() const;
  // Routed-expert parameters a step of `tokens` tokens leaves unread, expected under uniform
  // routing: E · (1 − k/E)^tokens experts' worth per MoE layer (E − k of them for one token).
  virtual double idle_expert_params(int64_t tokens) const {
    (void)tokens;
    return 0;
  }
  // Called after each optimizer step (MoE routers update their balancing bias here).
  virtual void after_step() const {}
  // The name a parameter has in a saved HF checkpoint (GPT-2 adds "transformer.").
  virtual std::string checkpoint_name(const std::string& name) const { return name; }

  // logits [B, T, V] (All) or [B, V] (Last) into `out`.
  void logits(const TokenBatch& batch, float* out, Logits which) const;
  // Greedy decoding: next[b] = the id of sequence b's largest last-position logit (the first of
  // equal ones, as std::max_element). On the device the pick runs there and only the B ids come
  // back, not B·V logits.
  void greedy(const TokenBatch& batch, int64_t* next) const;
  // One sequence (ids [T]) continuing ctx (or from scratch if null); convenience for decode.
  void forward(const int64_t* ids, int64_t T, Context* ctx, float* out, Logits which) const;
  // Mean next-token cross-entropy of batch against targets [B*T] (target < 0: ignored),
  // computed in vocabulary chunks.
  Var loss(const TokenBatch& batch, const std::vector<int64_t>& targets, float z_loss = 0.0f) const;
  // Auxiliary losses of the last forward (MoE sequence-level balance loss, DeepSeek-V3 form,
  // weighted by alpha); null when the model has none.
  virtual Var aux_loss(int64_t seq_len, float alpha) const { return nullptr; }

  int64_t total_params() const;
  size_t weight_bytes() const;  // bytes of the parameters as held now

  std::optional<int64_t> eos_token_id;
};

// Decoding of a fixed batch of contexts, one token per sequence per step: each step gives every
// sequence's greedy pick (Output::Picks, as Model::greedy) or its last-position logits
// (Output::Logits, as Model::logits with Logits::Last, for samplers and logprobs). On CUDA the
// second step is captured once as a CUDA graph (device::Graph) and replayed for it and every step
// after: one launch instead of a few hundred, and none of the host's per-op work. The replays
// find their token ids, positions and cache lengths through the capture's refreshed uploads; the
// contexts' counts move on the host after each. A step that cannot be replayed (a KV cache's
// per-sequence launches, routing read back to the host) throws during the capture: the capture is
// dropped, the contexts are set back, and every step runs as Model::greedy / Model::logits do
// (refusal() says why). Contexts moved by anything else between two steps (a forward over them,
// memories replaced by a clone) no longer fit the graph: it is dropped and captured again. The
// weights must not change while a decoder replays (the graph reads them where they were). A
// replayed step splits the latent attention for the caches' capacity, so its sums may differ
// from a queued step's in the last bits.
class Decoder {
 public:
  enum class Output { Picks, Logits };
  Decoder(const Model& model, std::vector<Context*> contexts, bool use_graph = true, Output output = Output::Picks);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  // Output::Picks: next[b] = sequence b's pick after ids[b].
  void step(const int64_t* ids, int64_t* next);
  // Output::Logits: logits [B, V] after ids.
  void step(const int64_t* ids, float* logits);
  Output output() const { return output_; }
  bool replaying() const;                               // the steps now run as graph replays
  const std::string& refusal() const { return refusal_; }  // why not, once a capture failed

 private:
  void run(const int64_t* ids, void* out);      // one step, either output
  void eager(const int64_t* ids, void* out);    // queued from the host
  void capture(const int64_t* ids, void* out);
  size_t out_bytes() const;
  std::vector<int64_t> counts() const;  // every context's position, memory lengths and identities
  const Model& model_;
  std::vector<Context*> contexts_;
  bool use_graph_;
  Output output_;
  int64_t steps_ = 0;
  std::string refusal_;
  std::unique_ptr<device::Graph> graph_;
  std::unique_ptr<device::Buffer> result_;  // the graph's picks or logits, on the device
  std::vector<int64_t> after_;  // counts() after the last replay: what the graph's uploads assume
};

// The storage of a model's weights for inference. gemm: the GEMM weights' storage as in move_to
// above. quantize (F8B128 or MXFP4; F32: none): the linear layers' weights quantised to that block
// format (core/quant.h), or with experts_only only the routed experts' ("....experts.N...."), as
// block_gemm_weight selects. Weights already packed (a checkpoint's FP8 or MXFP4, loaded with
// PackedWeights::Keep) stay as they are.
struct WeightStorage {
  DType gemm = DType::F32;
  DType quantize = DType::F32;
  bool experts_only = false;
};
// How loading holds the weights it reads. packed: a checkpoint's FP8 and MXFP4 weights inflated to
// fp32 or kept packed (where block_gemm_weight allows). place: each weight goes, as soon as it is
// read, to `device` in `storage` (move_to's rules), so the host holds one tensor at a time rather
// than the whole model in fp32; the device's free memory is checked before the first is read.
struct LoadPlan {
  PackedWeights packed = PackedWeights::Inflate;
  bool place = false;
  Device device{};
  WeightStorage storage;
  static LoadPlan inference(Device d, const WeightStorage& s) { return {PackedWeights::Keep, true, d, s}; }
  static LoadPlan packed_on_host() { return {PackedWeights::Keep, false, Device::CPU, {}}; }
};

// Fills every parameter from a checkpoint by its HF name. `alias` maps our name to the
// candidates to try in the file (e.g. with a "transformer." prefix). Shapes must match; dtypes
// are converted to fp32 (fp32 stays zero-copy). Tensors in the file that nothing asked for are
// reported unless `ignorable` says they are known buffers.
struct LoadOptions {
  std::function<std::vector<std::string>(const std::string&)> alias;
  std::function<bool(const std::string&)> ignorable;
  LoadPlan plan;
};
// MXFP4-packed parameters ("<name>_packed" + "<name>_scale", core/quant.h) and block-scaled FP8
// ones (F8_E4M3 "<name>" + float "<name>_scale_inv" per kFp8Block² block, as DeepSeek-V3 and Kimi
// ship them) are dequantised to fp32 on load, or with PackedWeights::Keep kept as MXFP4 and
// F8B128 tensors wherever block_gemm_weight says a linear layer multiplies them.
void load_params(const Model& model, const Checkpoint& ckpt, const LoadOptions& opts);
inline constexpr int64_t kFp8Block = 128;
Tensor load_fp8_blocks(const Checkpoint& ckpt, const std::string& name);  // w · scale_inv, block by block
Tensor load_mxfp4(const Checkpoint& ckpt, const std::string& name, const Shape& want);
// The same tensors kept packed (F8B128: each 128 × 128 tile's scale repeated on its rows).
Tensor load_fp8_packed(const Checkpoint& ckpt, const std::string& name);
Tensor load_mxfp4_packed(const Checkpoint& ckpt, const std::string& name, const Shape& want);
// A packed host weight as a checkpoint stores it: MXFP4 as "<name>_packed" + "<name>_scale",
// F8B128 as F8_E4M3 "<name>" + "<name>_scale_inv" (one fp32 scale per 128 × 128 tile).
std::vector<std::pair<std::string, Tensor>> packed_checkpoint_tensors(const std::string& name, const Tensor& w);

// Writes config.json + model.safetensors (HF names) into dir, each file atomically. Block-format
// weights are written in the layouts load_params reads (packed_checkpoint_tensors).
void save_model(const Model& model, const std::string& dir);

// Refuses weights holding NaN or infinite values (a corrupt checkpoint), naming the first tensor.
void check_weights_finite(const Model& model);

// Moves every parameter to `device`, so the model's forward runs there (each op dispatches on its
// inputs' device) and its new contexts hold device memories; logits come back to the host.
// gemm_weights BF16 (CUDA only) stores the matrices that feed GEMMs as bf16 (products
// accumulate in fp32; activations are rounded to bf16 at those GEMMs only); embeddings, norms,
// biases, gates, MoE routers and the MLA up-projection stay fp32 (bf16_gemm_weight says which).
void move_to(const Model& model, Device device, DType gemm_weights = DType::F32);
bool bf16_gemm_weight(const std::string& name, const Tensor& value, ParamKind kind);

void move_to(const Model& model, Device device, const WeightStorage& storage);
// A weight a linear layer multiplies that a block format can hold: a bf16_gemm_weight whose rows
// are whole blocks, not the LM head (kept as the checkpoint has it, as DeepSeek-V3's FP8 release
// does), in a model whose linear weights are [out, in].
bool block_gemm_weight(const Model& model, const std::string& name, const Tensor& value, ParamKind kind, DType fmt);
// `--quantize` spellings: fp8, mxfp4, fp8-experts, mxfp4-experts (false if none of them).
bool parse_quantize(const std::string& text, WeightStorage* storage);

// Gives every storage-less parameter zeros, e.g. before init_random.
void materialize_params(const Model& model);

}  // namespace k3
