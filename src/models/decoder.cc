// The decode step of models/model.h's Decoder: eager, or captured once as a CUDA graph and replayed
// (core/device.h's Graph) where the model lives on CUDA, the memories' lengths kept by the host.
#include <string>
#include <vector>

#include "core/device.h"
#include "models/lm_head.h"
#include "models/model.h"

namespace k3 {

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
        head_picks_on_device(model_.hidden(batch), batch, model_.head_weight(), result_->as<int64_t>());
      } else {  // lg is freed (into the capture's reserve) before the capture ends: its rows are
                // copied into the decoder's own buffer, which the replays download
        head_logits_on_device(model_.hidden(batch), batch, model_.head_weight(), result_->get());
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

}  // namespace k3
