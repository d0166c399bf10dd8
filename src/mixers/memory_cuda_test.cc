// Device memories copied to the host and back (Memory::clone_to, the prefix cache's host tier):
// every valid row and state value comes back bit for bit, the host copy holds the valid rows
// alone, and the copy back restores into a live device memory. Values are checked against the
// host arrays they were uploaded from.
#include <gtest/gtest.h>

#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "mixers/attention/kv_cache.h"
#include "mixers/linear/recurrent_state.h"
#include "mixers/mla/mla.h"
#include "mixers/token_rows.h"

namespace k3 {
namespace {

std::vector<float> download(const float* dev, int64_t n) {
  std::vector<float> h(static_cast<size_t>(n));
  device::download(h.data(), dev, size_t(n) * sizeof(float));
  device::synchronize();
  return h;
}

TEST(MemoryCuda, TokenRowsGoToTheHostAndBack) {
  Rng rng(3);
  const int64_t n = 37, max = 128;
  std::vector<float> a(size_t(n * 6)), b(size_t(n * 2));
  for (float& x : a) x = rng.normal();
  for (float& x : b) x = rng.normal();
  TokenRows r("test", {6, 2}, max, Device::CUDA);
  Tensor ta = Tensor::empty_on(Device::CUDA, {n, 6}), tb = Tensor::empty_on(Device::CUDA, {n, 2});
  device::upload(ta.raw(), a.data(), a.size() * sizeof(float));
  device::upload(tb.raw(), b.data(), b.size() * sizeof(float));
  r.reserve(n);
  r.append(0, static_cast<const float*>(ta.raw()), 6, n);
  r.append(1, static_cast<const float*>(tb.raw()), 2, n);
  r.advance(n);
  const TokenRows host = r.clone_to(Device::CPU);
  EXPECT_EQ(host.device(), Device::CPU);
  EXPECT_EQ(host.length(), n);
  EXPECT_EQ(host.bytes(), size_t(n * 8) * sizeof(float));  // the valid rows alone
  for (int64_t i = 0; i < n * 6; ++i) ASSERT_EQ(host.f32(0)[i], a[size_t(i)]) << i;
  for (int64_t i = 0; i < n * 2; ++i) ASSERT_EQ(host.f32(1)[i], b[size_t(i)]) << i;
  const TokenRows back = host.clone_to(Device::CUDA);
  EXPECT_EQ(back.capacity(), max);
  TokenRows live("test", {6, 2}, max, Device::CUDA);
  live.restore(back);
  EXPECT_EQ(live.length(), n);
  EXPECT_EQ(download(live.f32(0), n * 6), a);
  EXPECT_EQ(download(live.f32(1), n * 2), b);
}

TEST(MemoryCuda, Bf16LatentRowsAndStatesRoundTrip) {
  LatentStorage bf16(DType::BF16);
  Rng rng(4);
  const int64_t n = 9, width = 16;
  std::vector<float> rows(size_t(n * width));
  for (float& x : rows) x = rng.normal();
  LatentCache lat(width, 64, Device::CUDA);
  ASSERT_EQ(lat.rows().dtype(), DType::BF16);
  lat.extend_zeros(n);
  std::vector<uint16_t> bits(rows.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(i * 7919u);  // arbitrary bf16 patterns
  device::upload(lat.rows().raw(0), bits.data(), bits.size() * 2);
  auto host = lat.clone_to(Device::CPU);
  EXPECT_EQ(host->device(), Device::CPU);
  EXPECT_EQ(host->length(), n);
  auto back = host->clone_to(Device::CUDA);
  LatentCache live(width, 64, Device::CUDA);
  live.restore(*back);
  std::vector<uint16_t> got(bits.size());
  device::download(got.data(), live.rows().raw(0), got.size() * 2);
  device::synchronize();
  EXPECT_EQ(got, bits);

  RecurrentState s(2, 4, 3, /*normalizer=*/true, {5, 6}, 4, Device::CUDA);
  std::vector<float> S(2 * 4 * 3), z(2 * 4), t1(3 * 6);
  for (float& x : S) x = rng.normal();
  for (float& x : z) x = rng.normal();
  for (float& x : t1) x = rng.normal();
  device::upload(s.state(), S.data(), S.size() * 4);
  device::upload(s.normalizer(), z.data(), z.size() * 4);
  device::upload(s.conv_tail(1), t1.data(), t1.size() * 4);
  s.advance(11);
  auto hs = s.clone_to(Device::CPU);
  auto& h = static_cast<RecurrentState&>(*hs);
  EXPECT_EQ(h.device(), Device::CPU);
  EXPECT_EQ(std::vector<float>(h.state(), h.state() + S.size()), S);
  auto ds = hs->clone_to(Device::CUDA);
  RecurrentState live_s(2, 4, 3, true, {5, 6}, 4, Device::CUDA);
  live_s.restore(*ds);
  EXPECT_EQ(live_s.length(), 11);
  EXPECT_EQ(download(live_s.state(), int64_t(S.size())), S);
  EXPECT_EQ(download(live_s.normalizer(), int64_t(z.size())), z);
  EXPECT_EQ(download(live_s.conv_tail(1), int64_t(t1.size())), t1);
}

}  // namespace
}  // namespace k3
