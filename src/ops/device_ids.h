// Host index lists (token ids, positions, expert rows) uploaded for an op running on the device,
// shared with the backward closures that read them again. refresh: how a replayed decode step's
// CUDA graph renews them (core/device.h); None where a step that uploads them cannot be replayed.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"

namespace k3 {

using DeviceIds = std::shared_ptr<device::Buffer>;

inline DeviceIds upload_ids(const std::vector<int64_t>& v, device::Refresh refresh = device::Refresh::None) {
  return std::make_shared<device::Buffer>(device::upload_new(v.data(), v.size() * sizeof(int64_t), refresh));
}

}  // namespace k3
