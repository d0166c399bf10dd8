#include "core/host_memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace k3 {

namespace {
std::optional<size_t> read_number(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return std::nullopt;
  try {
    return size_t(std::stoull(s));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}
}  // namespace

std::optional<size_t> mem_available_from(const std::string& meminfo) {
  std::istringstream in(meminfo);
  std::string key, unit;
  size_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // reported in kB
  }
  return std::nullopt;
}

std::optional<size_t> peak_resident_bytes() {
  struct rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return std::nullopt;
  return size_t(u.ru_maxrss) * 1024;  // kilobytes on Linux
}

std::optional<size_t> host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  std::optional<size_t> avail = mem_available_from(ss.str());
  // cgroup v2: what the limit leaves.
  const auto limit = read_number("/sys/fs/cgroup/memory.max"), used = read_number("/sys/fs/cgroup/memory.current");
  if (limit && used) {
    const size_t left = *limit > *used ? *limit - *used : 0;
    avail = avail ? std::min(*avail, left) : left;
  }
  return avail;
}

}  // namespace k3
