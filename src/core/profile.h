// Where a step's time goes: named scopes, timed on the host wall clock, nested by path
// ("ffn moe / router"). Off by default, and then a Scope costs one branch. When on with
// `sync_device`, every scope boundary drains the device stream first, so a scope's time is its
// launches plus the device work they queued (the profiled step is slower than a real one: it
// loses the overlap of host and device, and pays the synchronisations).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace k3::profile {

void enable(bool sync_device);
void disable();
bool enabled();
void reset();  // clears the totals

struct Entry {
  std::string path;   // "parent / child"
  int depth = 0;      // number of parents
  double seconds = 0; // inclusive
  int64_t calls = 0;
};
// In first-seen order, which for a model's step is the order of its layers.
std::vector<Entry> entries();

class Scope {
 public:
  explicit Scope(std::string_view name) {
    if (enabled()) begin(name);
  }
  ~Scope() {
    if (open_) end();  // never throws
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void begin(std::string_view name);
  void end();
  bool open_ = false;
  size_t index_ = 0;
  uint64_t generation_ = 0;
  double t0_ = 0;
};

// The entries as an indented table: inclusive time per `per` (e.g. per step), its share of
// `total`, and the time no child scope accounts for ("(other)").
std::string format_table(double per, double total, const char* unit = "ms/step");

}  // namespace k3::profile
