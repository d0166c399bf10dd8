#include "core/profile.h"

#include <chrono>
#include <cstdio>
#include <map>

#include "core/device.h"

namespace k3::profile {
namespace {
struct State {
  bool on = false, sync = false;
  uint64_t generation = 0;  // bumped by reset(): scopes opened before it record nothing
  std::vector<Entry> entries;
  std::map<std::string, size_t> index;
  std::vector<size_t> stack;  // open scopes, innermost last
};
State& state() {
  static State s;
  return s;
}
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void enable(bool sync_device) {
  state().on = true;
  state().sync = sync_device;
}
void disable() { state().on = false; }
bool enabled() { return state().on; }
void reset() {
  State& s = state();
  s.entries.clear();
  s.index.clear();
  s.stack.clear();
  ++s.generation;
}

std::vector<Entry> entries() { return state().entries; }

void Scope::begin(std::string_view name) {
  State& s = state();
  std::string path = s.stack.empty() ? std::string(name) : s.entries[s.stack.back()].path + " / " + std::string(name);
  auto it = s.index.find(path);
  if (it == s.index.end()) {
    it = s.index.emplace(path, s.entries.size()).first;
    s.entries.push_back({path, int(s.stack.size()), 0.0, 0});
  }
  if (s.sync) device::synchronize();  // may throw: nothing is open yet
  index_ = it->second;
  generation_ = s.generation;
  s.stack.push_back(index_);
  open_ = true;
  t0_ = now();
}

void Scope::end() {
  State& s = state();
  open_ = false;
  if (generation_ != s.generation) return;  // a reset() inside the scope dropped it
  if (s.sync) {
    // A destructor must not throw: a device fault here resurfaces at the next device call.
    try {
      device::synchronize();
    } catch (...) {
    }
  }
  const double dt = now() - t0_;
  s.entries[index_].seconds += dt;
  s.entries[index_].calls += 1;
  if (!s.stack.empty() && s.stack.back() == index_) s.stack.pop_back();
}

std::string format_table(double per, double total, const char* unit) {
  const std::vector<Entry>& es = state().entries;
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-48s %10s %7s %7s\n", "scope", unit, "share", "calls");
  out += line;
  auto row = [&](const std::string& label, int depth, double sec, double calls) {
    const std::string name = std::string(size_t(2 * depth), ' ') + label;
    std::snprintf(line, sizeof line, "%-48s %10.3f %6.1f%% %7.1f\n", name.c_str(), 1e3 * sec / per,
                  total > 0 ? 100.0 * sec / total : 0.0, calls / per);
    out += line;
  };
  // Children follow their parent in first-seen order only when first seen together, so walk
  // the tree explicitly: a scope's children are the entries whose path extends it by one level.
  auto children_of = [&](const std::string& parent, int depth) {
    std::vector<size_t> c;
    for (size_t i = 0; i < es.size(); ++i)
      if (es[i].depth == depth && (depth == 0 || es[i].path.rfind(parent + " / ", 0) == 0)) c.push_back(i);
    return c;
  };
  auto walk = [&](auto&& self, size_t i) -> void {
    const Entry& e = es[i];
    const std::string label = e.path.substr(e.path.rfind(" / ") == std::string::npos ? 0 : e.path.rfind(" / ") + 3);
    row(label, e.depth, e.seconds, double(e.calls));
    const std::vector<size_t> kids = children_of(e.path, e.depth + 1);
    if (kids.empty()) return;
    double inner = 0;
    for (size_t k : kids) {
      self(self, k);
      inner += es[k].seconds;
    }
    if (e.seconds - inner > 0.005 * e.seconds) row("(other)", e.depth + 1, e.seconds - inner, double(e.calls));
  };
  double top = 0;
  for (size_t i : children_of("", 0)) {
    walk(walk, i);
    top += es[i].seconds;
  }
  if (total > top && total - top > 0.005 * total) row("(outside every scope)", 0, total - top, 0);
  return out;
}

}  // namespace k3::profile
