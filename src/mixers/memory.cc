#include "mixers/memory.h"

namespace k3 {

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
