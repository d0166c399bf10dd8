// Number formatting for the CLI's tables.
#pragma once

#include <cstdint>
#include <string>

#include "core/host_memory.h"

namespace k3::cli {

std::string with_commas(int64_t n);       // 124439808 -> "124,439,808"
using k3::human_bytes;                     // core/host_memory.h
std::string human_count(double n);        // 2.78e12 -> "2.78T"
std::string context_label(int64_t tokens);  // 1024 -> "1K", 1048576 -> "1M"

}  // namespace k3::cli
