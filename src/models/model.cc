#include "models/model.h"

#include <iostream>
#include <set>

namespace k3 {

int64_t Model::total_params() {
  int64_t n = 0;
  visit([&](const std::string&, Tensor& t, ParamKind) { n += t.numel(); });
  return n;
}

int64_t Model::active_params() {
  int64_t n = 0;
  visit([&](const std::string&, Tensor& t, ParamKind k) {
    if (k != ParamKind::Embedding) n += t.numel();
  });
  return n;
}

size_t Model::weight_bytes() {
  size_t n = 0;
  visit([&](const std::string&, Tensor& t, ParamKind) { n += t.nbytes(); });
  return n;
}

void load_params(Model& model, const Checkpoint& ckpt, const LoadOptions& opts) {
  std::set<std::string> used;
  std::vector<std::string> missing;
  model.visit([&](const std::string& name, Tensor& t, ParamKind) {
    std::vector<std::string> candidates = opts.alias ? opts.alias(name) : std::vector<std::string>{name};
    for (const auto& c : candidates) {
      if (!ckpt.has(c)) continue;
      const TensorEntry& e = ckpt.entry(c);
      if (e.shape != t.shape())
        throw error("load", ckpt.path(), ": tensor '", c, "' has shape ", shape_str(e.shape), " but the config implies ",
                    shape_str(t.shape()), " (config.json and weights disagree?)");
      t = ckpt.get_f32(c);
      used.insert(c);
      return;
    }
    missing.push_back(candidates.front());
  });
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ... (" + std::to_string(missing.size()) + " in all)";
    throw error("load", ckpt.path(), ": missing tensors: ", list);
  }
  std::vector<std::string> extra;
  for (const auto& n : ckpt.names())
    if (!used.count(n) && !(opts.ignorable && opts.ignorable(n))) extra.push_back(n);
  if (!extra.empty()) {
    std::cerr << "k3: warning: " << ckpt.path() << " has " << extra.size()
              << " tensor(s) this architecture does not use, e.g. '" << extra.front() << "'\n";
  }
}

void materialize_params(Model& model) {
  model.visit([](const std::string&, Tensor& t, ParamKind) {
    if (!t.has_storage() || t.numel() == 0) t = Tensor::zeros(t.shape());
  });
}

}  // namespace k3
