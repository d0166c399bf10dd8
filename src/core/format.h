// Number formatting for tables and messages.
#pragma once

#include <cstdint>
#include <string>

namespace k3 {

std::string with_commas(int64_t n);         // 124439808 -> "124,439,808"
std::string human_bytes(double bytes);      // 1536 -> "1.50 KiB"; 17 -> "17 B"
std::string human_count(double n);          // 2.78e12 -> "2.78T"
std::string context_label(int64_t tokens);  // 1024 -> "1K", 1048576 -> "1M"

}  // namespace k3
