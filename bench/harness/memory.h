// The harness of `k3 bench memory` (memory.cc): one sequence's memory, mechanism by mechanism, at
// context 1K..1M, measured by allocation; crossovers against softmax attention's KV cache; a plot.
#pragma once

#include <string>

namespace k3::bench {

struct MemoryBenchOptions {
  std::string out = "runs/bench-memory";  // folder for memory.svg and memory.json
  double budget_gib = 2.0;                // largest allocation measured; beyond, linear extrapolation
};
void run_memory_bench(const MemoryBenchOptions& o);

}  // namespace k3::bench
