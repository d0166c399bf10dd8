#include "ops/autograd.h"

#include <cstring>
#include <unordered_set>

#include "core/device.h"
#include "core/profile.h"

namespace k3 {

namespace {
thread_local bool g_recording = false;
}

bool recording() { return g_recording; }
Recording::Recording() : saved_(g_recording) { g_recording = true; }
Recording::~Recording() { g_recording = saved_; }
NoRecording::NoRecording() : saved_(g_recording) { g_recording = false; }
NoRecording::~NoRecording() { g_recording = saved_; }

float* Node::grad_f32() {
  if (value.device() == Device::CUDA)
    throw error("autograd", "a host gradient was asked of the device value ", value.describe(), " (op ", op,
                "): this op has no CUDA backward");
  if (!grad.defined() || !grad.has_storage()) grad = Tensor::zeros(value.shape());
  return grad.f32();
}

float* Node::grad_cuda() {
  if (value.device() != Device::CUDA)
    throw error("autograd", "a device gradient was asked of the host value ", value.describe(), " (op ", op, ")");
  if (!grad.defined() || !grad.has_storage()) {
    grad = Tensor::empty_on(Device::CUDA, value.shape());
    if (grad.nbytes()) device::zero(grad.raw(), grad.nbytes());
  }
  return grad.cuda_f32();
}

const Tensor& Node::grad_tensor() {
  if (value.device() == Device::CUDA)
    grad_cuda();
  else
    grad_f32();
  return grad;
}

Var constant(Tensor t) {
  auto n = std::make_shared<Node>();
  n->value = std::move(t);
  return n;
}

Var parameter(Shape shape) {
  auto n = std::make_shared<Node>();
  n->value = Tensor::meta(std::move(shape));
  n->requires_grad = true;
  n->op = "parameter";
  return n;
}

Var make_node(Tensor value, std::vector<Var> parents, std::function<void(Node&)> backward, const char* op) {
  auto n = std::make_shared<Node>();
  n->value = std::move(value);
  n->op = op;
  if (g_recording) {
    bool any = false;
    for (const auto& p : parents) any = any || needs_grad(p);
    if (any) {
      n->requires_grad = true;
      n->parents = std::move(parents);
      n->backward = std::move(backward);
    }
  }
  return n;
}

void backward(const Var& out, const Tensor& seed) {
  K3_CHECK(out && out->requires_grad, "backward from a value that does not require grad");
  // Topological order by iterative DFS.
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack{{out.get(), 0}};
  seen.insert(out.get());
  while (!stack.empty()) {
    auto& [node, i] = stack.back();
    if (i < node->parents.size()) {
      Node* p = node->parents[i++].get();
      if (p && p->requires_grad && p->backward && !seen.count(p)) {
        seen.insert(p);
        stack.push_back({p, 0});
      }
    } else {
      order.push_back(node);
      stack.pop_back();
    }
  }
  if (seed.defined()) {
    out->grad = seed.device() == out->value.device() ? seed.clone() : seed.to_device(out->value.device());
  } else {
    Tensor ones = Tensor::full(out->value.shape(), 1.0f);
    out->grad = out->value.device() == Device::CPU ? ones : ones.to_device(out->value.device());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* n = *it;
    if (n->backward && n->grad.defined()) {
      const profile::Scope scope(n->op);  // `k3 train --profile`: the backward, op by op
      n->backward(*n);
    }
  }
  // Free the graph: intermediate nodes drop parents, closures and grads.
  for (Node* n : order) {
    n->parents.clear();
    n->backward = nullptr;
    if (n != out.get()) n->grad = Tensor();
  }
}

}  // namespace k3
