// Parameters: every module lists its parameters once, by their Hugging Face names, through a
// visitor. That one list drives loading, saving, counting, zero-grad, clipping and AdamW.
// A parameter is a leaf Var (autograd.h): value + grad.
#pragma once

#include <functional>
#include <string>

#include "ops/autograd.h"

namespace k3 {

// What a parameter is, for optimiser defaults (no weight decay on norms, biases, embeddings).
enum class ParamKind : uint8_t { Weight, Bias, Norm, Embedding, Other };

using ParamVisitor = std::function<void(const std::string& name, Node& param, ParamKind kind)>;

// Joins module path components: join_name("h.0", "attn") == "h.0.attn".
inline std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace k3
