#include "core/host_memory.h"

#include "core/format.h"

#include <gtest/gtest.h>

namespace k3 {
namespace {

TEST(HostMemory, ReadsMemAvailableFromMeminfo) {
  const std::string meminfo =
      "MemTotal:       24634292 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\nBuffers: 0 kB\n";
  ASSERT_TRUE(mem_available_from(meminfo));
  EXPECT_EQ(*mem_available_from(meminfo), size_t(20971520) * 1024);  // 20 GiB
  EXPECT_FALSE(mem_available_from("MemTotal: 1 kB\n"));
  // The live figure exists on Linux and is below what the machine has in all.
  const auto live = host_available_bytes();
  ASSERT_TRUE(live);
  EXPECT_GT(*live, 0u);
}

TEST(HostMemory, HumanBytes) {
  EXPECT_EQ(human_bytes(17), "17 B");
  EXPECT_EQ(human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(human_bytes(3.0 * (1ull << 40)), "3.00 TiB");
}

}  // namespace
}  // namespace k3
