// k3: the command-line entry point. Errors surface here: k3::Error (user-facing) and anything
// else are printed to stderr with a non-zero exit code.
#include <malloc.h>

#include <iostream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"

namespace k3::cli {

void add_runtime_options(CLI::App* cmd, RuntimeOptions& opts) {
  cmd->add_option("--threads", opts.threads, "CPU threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--device", opts.device, "Where to run: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
}

void apply_runtime_options(const RuntimeOptions& opts) {
  if (opts.device == "cuda")
    throw error("cli", "--device cuda: this k3 was built without the CUDA backend (configure with -DK3_CUDA=ON)");
  set_num_threads(opts.threads);
}

}  // namespace k3::cli

int main(int argc, char** argv) {
  // Activations are large, short-lived buffers: keep freed memory in the heap instead of
  // returning it to the kernel (mmap/munmap + page faults on every op otherwise).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"k3: load, run, train and measure the GPT-2 -> linear attention -> DeltaNet -> "
               "Gated DeltaNet -> KDA -> Kimi K3 family of language models.",
               "k3"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  k3::cli::register_info(app);
  k3::cli::register_logits(app);
  k3::cli::register_generate(app);
  k3::cli::register_op(app);
  k3::cli::register_bench(app);
  k3::cli::register_train(app);
  k3::cli::register_eval(app);
  k3::cli::register_tokenizer(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const k3::Error& e) {
    std::cerr << "k3: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "k3: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
