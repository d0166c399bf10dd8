// Two error tiers (ARCHITECTURE.md, Conventions):
//  - k3::Error: user-facing failures (bad file, wrong config, bad request). The message reads
//    "[component] what happened, which values; hint". The CLI prints it and exits non-zero.
//  - K3_CHECK: internal invariants, always on (also in release builds). A failure is a bug in k3.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace k3 {

class Error : public std::runtime_error {
 public:
  Error(std::string component, const std::string& message)
      : std::runtime_error("[" + component + "] " + message), component_(std::move(component)) {}
  const std::string& component() const { return component_; }

 private:
  std::string component_;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace detail

// Builds a k3::Error from streamable pieces: throw k3::error("safetensors", "bad header in ", path);
template <class... Args>
Error error(const std::string& component, Args&&... args) {
  return Error(component, detail::concat(std::forward<Args>(args)...));
}

}  // namespace k3

#define K3_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond)) [[unlikely]]                                                            \
      ::k3::detail::check_failed(#cond, __FILE__, __LINE__, ::k3::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
