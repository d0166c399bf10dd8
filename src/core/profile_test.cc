#include "core/profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace k3 {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(Profile, OffScopesRecordNothing) {
  profile::disable();
  profile::reset();
  { profile::Scope s("idle"); }
  EXPECT_TRUE(profile::entries().empty());
}

TEST(Profile, NestedScopesSumIntoTheirPaths) {
  profile::reset();
  profile::enable(false);
  for (int step = 0; step < 2; ++step) {
    profile::Scope layer("layer");
    {
      profile::Scope a("mixer");
      sleep_ms(20);
    }
    {
      profile::Scope b("ffn");
      { profile::Scope r("router"); }
      sleep_ms(10);
    }
  }
  profile::disable();
  const auto es = profile::entries();
  ASSERT_EQ(es.size(), 4u);
  EXPECT_EQ(es[0].path, "layer");
  EXPECT_EQ(es[1].path, "layer / mixer");
  EXPECT_EQ(es[2].path, "layer / ffn");
  EXPECT_EQ(es[3].path, "layer / ffn / router");
  EXPECT_EQ(es[3].depth, 2);
  for (const auto& e : es) EXPECT_EQ(e.calls, 2) << e.path;
  // Sleeps bound the times from below; a parent contains its children.
  EXPECT_GE(es[1].seconds, 0.040);
  EXPECT_GE(es[2].seconds, 0.020);
  EXPECT_GE(es[0].seconds, es[1].seconds + es[2].seconds);
  EXPECT_GE(es[2].seconds, es[3].seconds);
  const std::string table = profile::format_table(2.0, es[0].seconds);
  EXPECT_NE(table.find("  mixer"), std::string::npos) << table;
  EXPECT_NE(table.find("    router"), std::string::npos) << table;
  EXPECT_NE(table.find("(other)"), std::string::npos) << table;  // ffn's own sleep
  profile::reset();
  EXPECT_TRUE(profile::entries().empty());
}

TEST(Profile, AResetInsideAScopeDropsIt) {
  profile::reset();
  profile::enable(false);
  {
    profile::Scope outer("outer");
    profile::reset();
    profile::Scope inner("inner");  // a root now: outer no longer exists
  }
  profile::disable();
  const auto es = profile::entries();
  ASSERT_EQ(es.size(), 1u);
  EXPECT_EQ(es[0].path, "inner");
  EXPECT_EQ(es[0].depth, 0);
  EXPECT_EQ(es[0].calls, 1);
}

}  // namespace
}  // namespace k3
