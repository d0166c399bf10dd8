// How much memory this process may still take on the host: the kernel's MemAvailable, lowered to
// what the cgroup's limit leaves (a container's memory.max) when there is one. Loading checks a
// model's weights against it, so a model too large for the machine is refused with the bytes it
// needs instead of being killed halfway through.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace k3 {

// Bytes available, or nullopt where the system does not say (no /proc/meminfo).
std::optional<size_t> host_available_bytes();
// The most memory this process has held at once so far (its resident high-water mark), or
// nullopt where the system does not say.
std::optional<size_t> peak_resident_bytes();
// Parses /proc/meminfo text: MemAvailable in bytes.
std::optional<size_t> mem_available_from(const std::string& meminfo);

}  // namespace k3
