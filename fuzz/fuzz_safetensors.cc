// Fuzz target: the safetensors reader must reject any malformed buffer with k3::Error and never
// read out of bounds; every tensor it accepts must be readable in full.
#include <cstddef>
#include <cstdint>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto buf = std::make_shared<std::vector<char>>(reinterpret_cast<const char*>(data),
                                                 reinterpret_cast<const char*>(data) + size);
  try {
    k3::SafeTensors s = k3::SafeTensors::from_buffer(buf, "fuzz.safetensors");
    volatile uint8_t sink = 0;
    for (const auto& name : s.names()) {
      k3::Tensor t = s.get(name);
      const uint8_t* p = static_cast<const uint8_t*>(t.raw());
      for (size_t i = 0; i < t.nbytes(); ++i) sink = sink ^ p[i];
      if (t.numel() < (1 << 16)) (void)s.get_f32(name);
    }
  } catch (const k3::Error&) {
  }
  return 0;
}
