// k3 bench memory: flags; the harness is bench/harness/memory.h.
#include "bench/harness/memory.h"
#include "cli/commands.h"

namespace k3::cli {

void register_bench_memory(CLI::App* bench) {
  auto* cmd = bench->add_subcommand("memory", "Per-sequence memory of every mechanism at context 1K..1M, crossovers and a plot");
  static bench::MemoryBenchOptions o;
  cmd->add_option("--out", o.out, "Folder for memory.svg and memory.json")->capture_default_str();
  cmd->add_option("--budget-gib", o.budget_gib, "Largest allocation measured; above it growth is extrapolated")->capture_default_str();
  cmd->callback([] { bench::run_memory_bench(o); });
}

}  // namespace k3::cli
