// The memory classes' own contracts (host forms): rows kept per token, deep snapshots, limits.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "mixers/attention/kv_cache.h"
#include "mixers/linear/recurrent_state.h"
#include "mixers/mla/mla.h"
#include "mixers/token_rows.h"

namespace k3 {

TEST(TokenRows, GrowsKeepsRowsAndRefusesPastItsLimit) {
  TokenRows r("test", {3, 2}, 40, Device::CPU);
  std::vector<float> src(30 * 5);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i);
  for (int step = 0; step < 3; ++step) {  // 10 rows at a time: the capacity doubles past 16
    r.reserve(10);
    r.append(0, src.data() + step * 50, 5, 10);
    r.append(1, src.data() + step * 50 + 3, 5, 10);
    r.advance(10);
  }
  EXPECT_EQ(r.length(), 30);
  EXPECT_GE(r.capacity(), 30);
  for (int64_t t = 0; t < 30; ++t) {
    for (int64_t c = 0; c < 3; ++c) ASSERT_EQ(r.f32(0)[t * 3 + c], src[size_t(t * 5 + c)]) << t;
    for (int64_t c = 0; c < 2; ++c) ASSERT_EQ(r.f32(1)[t * 2 + c], src[size_t(t * 5 + 3 + c)]) << t;
  }
  EXPECT_THROW(r.reserve(11), Error);  // 41 > 40
  r.extend_zeros(10);
  EXPECT_EQ(r.length(), 40);
  for (int64_t i = 30 * 3; i < 40 * 3; ++i) EXPECT_EQ(r.f32(0)[i], 0.0f);
  EXPECT_THROW(TokenRows("test", {4}, 8, Device::CPU, DType::BF16), Error);  // bf16 rows live on CUDA only
}

TEST(TokenRows, CloneIsDeepAndRestoreCopiesBack) {
  TokenRows r("test", {2}, 64, Device::CPU);
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  r.reserve(2);
  r.append(0, a, 2, 2);
  r.advance(2);
  TokenRows snap = r.clone();
  r.reserve(2);
  r.append(0, b, 2, 2);
  r.advance(2);
  r.f32(0)[0] = -1;  // the snapshot must not see this
  EXPECT_EQ(snap.length(), 2);
  EXPECT_EQ(snap.f32(0)[0], 1.0f);
  TokenRows fresh("test", {2}, 64, Device::CPU);
  fresh.restore(snap);
  EXPECT_EQ(fresh.length(), 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(fresh.f32(0)[i], a[i]);
  EXPECT_THROW(fresh.restore(TokenRows("test", {3}, 64, Device::CPU)), Error);
}

// keys() and values() read the token-major rows as [token, head, hd] views.
TEST(KvCacheMemory, HeadViewsReadWhatWasAppended) {
  const int64_t H = 2, hd = 3, n = 5;
  KVCache cache(H, hd, 16);
  std::vector<float> k(size_t(n * H * hd)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(i), v[i] = float(100 + i);
  cache.append({k.data(), H * hd, hd}, {v.data(), H * hd, hd}, n);
  auto copy = cache.clone();
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  cache.restore(*copy);
  ASSERT_EQ(cache.length(), n);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        EXPECT_EQ(cache.keys().at(t, h)[d], k[size_t((t * H + h) * hd + d)]);
        EXPECT_EQ(cache.values().at(t, h)[d], v[size_t((t * H + h) * hd + d)]);
      }
  EXPECT_THROW(cache.append({k.data(), H * hd, hd}, {v.data(), H * hd, hd}, 12), Error);  // 17 > 16
  EXPECT_EQ(cache.length(), n);  // refused whole
  EXPECT_THROW(cache.set_length(2), Error);  // a host memory's length follows its contents
}

// Truncation takes tokens back from the caches that keep every token, and is refused elsewhere.
TEST(KvCacheMemory, TruncateTakesTokensBack) {
  const int64_t H = 1, hd = 2;
  KVCache cache(H, hd, 16);
  EXPECT_TRUE(cache.can_truncate());
  const std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {7, 8};
  cache.append({const_cast<float*>(a.data()), hd, hd}, {const_cast<float*>(a.data()), hd, hd}, 3);
  cache.truncate(1);
  EXPECT_EQ(cache.length(), 1);
  cache.append({const_cast<float*>(b.data()), hd, hd}, {const_cast<float*>(b.data()), hd, hd}, 1);
  EXPECT_EQ(cache.length(), 2);
  EXPECT_EQ(cache.keys().at(0, 0)[1], 2.0f);
  EXPECT_EQ(cache.keys().at(1, 0)[0], 7.0f);
  EXPECT_THROW(cache.truncate(3), Error);  // past its length
  KVCache with_tail(H, hd, 16, 3, 4);
  EXPECT_FALSE(with_tail.can_truncate());
  EXPECT_THROW(with_tail.truncate(0), Error);
  RecurrentState state(1, 2, 2, false, {}, 0);
  EXPECT_FALSE(state.can_truncate());
  EXPECT_THROW(state.truncate(0), Error);
  LatentCache lat(2, 8);
  lat.append(a.data(), 3);
  lat.truncate(2);
  EXPECT_EQ(lat.length(), 2);
  EXPECT_EQ(lat.data()[3], 4.0f);
}

TEST(LatentCacheMemory, AppendCloneRestore) {
  LatentCache c(4, 8);
  const std::vector<float> rows = {1, 2, 3, 4, 5, 6, 7, 8};
  c.append(rows.data(), 2);
  auto snap = c.clone();
  c.append(rows.data(), 2);
  EXPECT_EQ(c.length(), 4);
  EXPECT_EQ(c.bytes() >= 4 * 4 * sizeof(float), true);
  c.restore(*snap);
  EXPECT_EQ(c.length(), 2);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(c.data()[i], rows[size_t(i)]);
  EXPECT_THROW(c.append(rows.data(), 7), Error);  // 9 > 8
  EXPECT_EQ(LatentCache::value_bytes(Device::CPU), sizeof(float));
}

TEST(RecurrentStateMemory, CloneIsDeepAndResetZeroes) {
  RecurrentState s(2, 3, 4, /*normalizer=*/true, {5, 5, 6}, 4);
  EXPECT_EQ(s.state_bytes(), size_t(2 * 3 * 4 + 2 * 3) * sizeof(float));
  EXPECT_EQ(s.conv_bytes(), size_t(3 * (5 + 5 + 6)) * sizeof(float));
  EXPECT_EQ(s.tail_width(2), 6);
  s.state()[7] = 1.5f, s.normalizer()[1] = 2.5f, s.conv_tail(2)[17] = 3.5f;
  s.advance(3);
  auto snap = s.clone();
  s.state()[7] = 0.0f, s.conv_tail(2)[17] = 0.0f;
  auto& c = static_cast<RecurrentState&>(*snap);
  EXPECT_EQ(c.state()[7], 1.5f);
  EXPECT_EQ(c.conv_tail(2)[17], 3.5f);
  s.reset();
  EXPECT_EQ(s.normalizer()[1], 0.0f);
  EXPECT_EQ(s.length(), 0);
  s.restore(c);
  EXPECT_EQ(s.state()[7], 1.5f);
  EXPECT_EQ(s.normalizer()[1], 2.5f);
  EXPECT_EQ(s.conv_tail(2)[17], 3.5f);
  EXPECT_EQ(s.length(), 3);
  EXPECT_THROW(s.restore(RecurrentState(2, 3, 4, false, {5, 5, 6}, 4)), Error);
  EXPECT_THROW(s.set_length(1), Error);
}

}  // namespace k3
