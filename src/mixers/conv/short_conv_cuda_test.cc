// The decode's short convolutions on the device (cuda::convs_with_tails: every stream of a delta
// layer in one launch, continuing each sequence's tail; longer continuations in two) against the
// definition computed here in
// double precision: y[t, c] = Σ_i w[c, i] · [tail ; x][t + i, c], SiLU when asked, and the tail
// left as the last W − 1 rows of [tail ; x].
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "mixers/mixers_cuda.h"

namespace k3 {
namespace {

std::vector<float> random_values(Rng& rng, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = rng.normal();
  return v;
}

TEST(ConvCuda, StreamsInOneLaunchMatchTheDefinition) {
  Rng rng(5);
  const std::vector<int64_t> Cs = {5, 33, 3};
  const int64_t B = 3;
  for (int64_t W : {1, 2, 4})
    for (int64_t T : {1, 6, 40})  // 40: the two-launch form of longer continuations
      for (bool silu : {false, true}) {
        const int S = int(Cs.size()), P = int(W - 1);
        std::vector<std::vector<float>> x(Cs.size()), w(Cs.size()), tail(Cs.size() * B);
        std::vector<device::Buffer> dx, dw, dy, dtail;
        cuda::ConvStreams st;
        st.count = S;
        for (int s = 0; s < S; ++s) {
          const int64_t C = Cs[size_t(s)];
          x[size_t(s)] = random_values(rng, B * T * C);
          w[size_t(s)] = random_values(rng, C * W);
          dx.push_back(device::upload_new(x[size_t(s)].data(), x[size_t(s)].size() * 4));
          dw.push_back(device::upload_new(w[size_t(s)].data(), w[size_t(s)].size() * 4));
          dy.emplace_back(size_t(B * T * C) * 4);
          st.x[s] = dx.back().as<float>(), st.w[s] = dw.back().as<float>(), st.y[s] = dy.back().as<float>();
          st.start[s + 1] = st.start[s] + C;
        }
        std::vector<float*> tails;
        for (int64_t b = 0; b < B; ++b)
          for (int s = 0; s < S; ++s) {
            auto& t = tail[size_t(b * S + s)];
            t = random_values(rng, P * Cs[size_t(s)]);
            dtail.push_back(device::upload_new(t.data(), t.size() * 4));
            tails.push_back(dtail.back().as<float>());
          }
        const device::Buffer d_tails = device::upload_new(tails.data(), tails.size() * sizeof(float*));
        cuda::convs_with_tails(st, d_tails.as<float*>(), B, T, W, silu);
        const std::string label = "W " + std::to_string(W) + " T " + std::to_string(T) + (silu ? " silu" : "");
        for (int s = 0; s < S; ++s) {
          const int64_t C = Cs[size_t(s)];
          std::vector<float> y(size_t(B * T * C));
          device::download(y.data(), dy[size_t(s)].get(), y.size() * 4);
          for (int64_t b = 0; b < B; ++b) {
            const std::vector<float>& t0 = tail[size_t(b * S + s)];
            // [tail ; x_b] row r, column c.
            auto row = [&](int64_t r, int64_t c) -> double {
              return r < P ? t0[size_t(r * C + c)] : x[size_t(s)][size_t((b * T + r - P) * C + c)];
            };
            for (int64_t t = 0; t < T; ++t)
              for (int64_t c = 0; c < C; ++c) {
                double acc = 0;
                for (int64_t i = 0; i < W; ++i) acc += double(w[size_t(s)][size_t(c * W + i)]) * row(t + i, c);
                if (silu) acc = acc / (1.0 + std::exp(-acc));
                ASSERT_NEAR(y[size_t((b * T + t) * C + c)], acc, 1e-5 * (1 + std::fabs(acc)))
                    << label << " stream " << s << " b " << b << " t " << t << " c " << c;
              }
            std::vector<float> got(size_t(P * C));
            device::download(got.data(), dtail[size_t(b * S + s)].get(), got.size() * 4);
            for (int64_t r = 0; r < P; ++r)
              for (int64_t c = 0; c < C; ++c)
                ASSERT_EQ(got[size_t(r * C + c)], float(row(T + r, c))) << label << " tail, stream " << s << " b " << b;
          }
        }
      }
}

TEST(ConvCuda, RefusesWhatTheKernelCannotHold) {
  cuda::ConvStreams st;
  EXPECT_THROW(cuda::convs_with_tails(st, nullptr, 1, 1, 4, false), Error);  // no streams
  st.count = 1;
  st.start[1] = 4;
  EXPECT_THROW(cuda::convs_with_tails(st, nullptr, 1, 1, 40, false), Error);  // wider than the kernel's window
}

}  // namespace
}  // namespace k3
