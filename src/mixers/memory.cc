#include "mixers/memory.h"

#include "core/error.h"

namespace k3 {

void Memory::set_length(int64_t) {
  throw error(std::string(memory_kind_name(kind())), "only a device memory's length can be set without its contents");
}

std::unique_ptr<Memory> Memory::clone_to(Device d) const {
  if (d != device())
    throw error(std::string(memory_kind_name(kind())), "this memory cannot be copied to another device");
  return clone();
}

void Memory::truncate(int64_t) {
  throw error(std::string(memory_kind_name(kind())), "this memory cannot be truncated (restore a snapshot instead)");
}

std::string_view memory_kind_name(MemoryKind k) {
  switch (k) {
    case MemoryKind::KVCache: return "kv-cache";
    case MemoryKind::LatentCache: return "latent-cache";
    case MemoryKind::RecurrentState: return "recurrent-state";
    case MemoryKind::ConvTail: return "conv-tail";
  }
  return "?";
}

}  // namespace k3
