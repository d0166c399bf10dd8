#include "core/error.h"

namespace k3::detail {

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::string text = concat("internal check failed: ", expr, " at ", file, ":", line);
  if (!msg.empty()) text += concat(" (", msg, ")");
  // Internal invariants are bugs, but we still unwind so that the CLI can report and exit cleanly.
  throw Error("k3", text);
}

}  // namespace k3::detail
