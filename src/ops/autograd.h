// Reverse-mode automatic differentiation over whole-tensor ops.
//
// A Var is a node of the graph: its value, its gradient, the Vars it was computed from and a
// closure that pushes its gradient to them. Ops (ag_*.h) define forward and backward side by
// side; modules and models only compose ops, so one forward serves inference (recording off:
// no graph, no saved activations) and training (recording on, then backward(loss)).
// Parameters are leaf Vars that require grad; their .grad accumulates across backward calls
// (gradient accumulation) until zeroed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace k3 {

struct Node;
using Var = std::shared_ptr<Node>;

struct Node {
  Tensor value;
  Tensor grad;  // undefined until something flows into it
  bool requires_grad = false;
  std::vector<Var> parents;
  std::function<void(Node& self)> backward;  // reads self.grad, accumulates into parents
  const char* op = "leaf";

  // Zero-initialised gradient buffer shaped like value (allocated on first use): on the host for a
  // host value (grad_f32; throws for a device value), on the device for a CUDA value (grad_cuda,
  // a device pointer; the ops' CUDA backward closures use it).
  float* grad_f32();
  float* grad_cuda();
  // The same on whichever device the value lives: the gradient buffer itself.
  const Tensor& grad_tensor();
};

// Whether ops record the graph. Off by default; a Recording scope turns it on.
bool recording();
class Recording {
 public:
  Recording();
  ~Recording();
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

 private:
  bool saved_;
};

// Turns recording off for its scope (work inside a backward closure that reuses forward ops).
class NoRecording {
 public:
  NoRecording();
  ~NoRecording();
  NoRecording(const NoRecording&) = delete;
  NoRecording& operator=(const NoRecording&) = delete;

 private:
  bool saved_;
};

Var constant(Tensor t);                 // no gradient
Var parameter(Shape shape);             // storage-less until loaded or initialised; requires grad

// Makes the output node of an op. If recording and any input requires grad, the node keeps
// its parents and the backward closure; otherwise they are dropped on the spot.
Var make_node(Tensor value, std::vector<Var> parents, std::function<void(Node&)> backward, const char* op);
inline bool needs_grad(const Var& v) { return v && v->requires_grad; }

// Runs backward from a scalar (or any) output with seed gradient 1 (or `seed`), in reverse
// topological order. Intermediate graph nodes are released afterwards.
void backward(const Var& out, const Tensor& seed = Tensor());

}  // namespace k3
