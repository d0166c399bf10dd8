// Fuzz target: config.json text through the registry (architecture lookup, typed fields,
// validation, storage-less model construction and the parameter report). Bad input must end
// in k3::Error, never a crash, a hang or an allocation blow-up.
#include <cstddef>
#include <cstdint>

#include "models/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  k3::Json j;
  try {
    j = k3::Json::parse(data, data + size);
  } catch (const k3::Json::exception&) {
    return 0;
  }
  try {
    k3::ArchReport r = k3::report_config(j, "fuzz/config.json");
    (void)r.sequence_bytes(1 << 20);
  } catch (const k3::Error&) {
  }
  return 0;
}
