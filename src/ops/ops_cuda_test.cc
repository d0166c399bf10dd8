// The ops' CUDA kernels (ops_cuda.h) against their CPU functions on random data (fp32 within
// 1e-4 relative L2, bf16 storage within 5e-3), and the cross-entropy and AdamW kernels against
// closed forms in double. Needs a GPU: label "gpu". One file of about 1,100 lines: a test per op,
// sharing the random-data and comparison helpers at its top.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/embedding.h"
#include "ops/gates.h"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/ops_cuda.h"
#include "ops/rope.h"
#include "ops/situ.h"

namespace k3 {
namespace {

using device::Buffer;
using device::Storage;

std::vector<float> randv(Rng& rng, int64_t n, float scale = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = scale * rng.normal();
  return v;
}
std::vector<float> bf16_round(std::vector<float> v) {
  for (float& x : v) x = round_to_bf16(x);
  return v;
}
Buffer up(const std::vector<float>& v, Storage st = Storage::F32) {
  return device::upload_values(v.data(), int64_t(v.size()), st);
}
std::vector<float> down(const Buffer& b, int64_t n, Storage st = Storage::F32) {
  std::vector<float> v(static_cast<size_t>(n));
  device::download_values(v.data(), b, n, st);
  return v;
}
double rel(const std::vector<float>& x, const std::vector<float>& ref) {
  EXPECT_EQ(x.size(), ref.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < x.size() && i < ref.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
std::vector<float> zeros(int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); }
size_t esize(Storage st) { return st == Storage::BF16 ? 2 : 4; }
double tol(Storage st) { return st == Storage::BF16 ? 5e-3 : 1e-4; }

class OpsCuda : public ::testing::TestWithParam<Storage> {};

TEST_P(OpsCuda, LayerNormAndRmsNormForwardBackward) {
  const Storage st = GetParam();
  Rng rng(1);
  // 7000: wider than the backward's shared-memory sums. 768 at M 5000: the warp-per-row backward
  // walks several rows per warp (its dw/db summed over them).
  for (const auto& [D, M] : {std::pair<int64_t, int64_t>{64, 37}, {768, 37}, {1000, 37}, {7000, 37}, {768, 5000}}) {
    // Inputs as the device stores them (bf16-rounded for bf16) so both sides see the same values.
    auto x = randv(rng, M * D), dy = randv(rng, M * D), w = randv(rng, D), b = randv(rng, D);
    if (st == Storage::BF16) x = bf16_round(x), dy = bf16_round(dy);
    std::vector<float> y = zeros(int64_t(x.size())), mean = zeros(M), rstd = zeros(M), dx = zeros(int64_t(x.size())), dw = zeros(D), db = zeros(D);
    layernorm_forward(x.data(), w.data(), b.data(), 1e-5f, M, D, y.data(), mean.data(), rstd.data());
    layernorm_backward(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), M, D, dx.data(), dw.data(), db.data());
    Buffer gx = up(x, st), gdy = up(dy, st), gw = up(w), gb = up(b), gy(x.size() * esize(st)), gm(size_t(M) * 4),
           gr(size_t(M) * 4), gdx(x.size() * esize(st)), gdw = device::zeros_f32(D), gdb = device::zeros_f32(D);
    cuda::layernorm_forward(gx.get(), gw.as<float>(), gb.as<float>(), 1e-5f, M, D, gy.get(), gm.as<float>(),
                            gr.as<float>(), st);
    cuda::layernorm_backward(gx.get(), gw.as<float>(), gm.as<float>(), gr.as<float>(), gdy.get(), M, D, gdx.get(),
                             gdw.as<float>(), gdb.as<float>(), st);
    EXPECT_LE(rel(down(gy, M * D, st), y), tol(st)) << "layernorm y D=" << D;
    EXPECT_LE(rel(down(gdx, M * D, st), dx), tol(st)) << "layernorm dx D=" << D;
    EXPECT_LE(rel(down(gdw, D), dw), tol(st)) << "layernorm dw D=" << D;
    EXPECT_LE(rel(down(gdb, D), db), tol(st)) << "layernorm db D=" << D;
    // accumulate: a second backward into the same dx adds the gradient again (as dw and db do).
    cuda::layernorm_backward(gx.get(), gw.as<float>(), gm.as<float>(), gr.as<float>(), gdy.get(), M, D, gdx.get(),
                             gdw.as<float>(), gdb.as<float>(), st, /*accumulate=*/true);
    std::vector<float> dx2 = dx;
    for (float& v : dx2) v *= 2.0f;
    EXPECT_LE(rel(down(gdx, M * D, st), dx2), tol(st)) << "layernorm dx accumulated D=" << D;
    std::vector<float> dw2 = dw, db2 = db;
    for (float& v : dw2) v *= 2.0f;
    for (float& v : db2) v *= 2.0f;
    EXPECT_LE(rel(down(gdw, D), dw2), tol(st)) << "layernorm dw accumulated D=" << D;
    EXPECT_LE(rel(down(gdb, D), db2), tol(st)) << "layernorm db accumulated D=" << D;

    std::vector<float> ry = zeros(int64_t(x.size())), rr = zeros(M), rdx = zeros(int64_t(x.size())), rdw = zeros(D);
    rmsnorm_forward(x.data(), w.data(), 1e-6f, M, D, ry.data(), rr.data());
    rmsnorm_backward(x.data(), w.data(), rr.data(), dy.data(), M, D, rdx.data(), rdw.data());
    Buffer hy(x.size() * esize(st)), hr(size_t(M) * 4), hdx(x.size() * esize(st)), hdw = device::zeros_f32(D);
    cuda::rmsnorm_forward(gx.get(), gw.as<float>(), 1e-6f, M, D, hy.get(), hr.as<float>(), st);
    cuda::rmsnorm_backward(gx.get(), gw.as<float>(), hr.as<float>(), gdy.get(), M, D, hdx.get(), hdw.as<float>(), st);
    EXPECT_LE(rel(down(hy, M * D, st), ry), tol(st)) << "rmsnorm y D=" << D;
    EXPECT_LE(rel(down(hdx, M * D, st), rdx), tol(st)) << "rmsnorm dx D=" << D;
    EXPECT_LE(rel(down(hdw, D), rdw), tol(st)) << "rmsnorm dw D=" << D;
  }
}

TEST_P(OpsCuda, GeluAndSituForwardBackward) {
  const Storage st = GetParam();
  Rng rng(2);
  const int64_t n = 100003;
  auto x = randv(rng, n, 3.0f), u = randv(rng, n, 10.0f), dy = randv(rng, n);
  if (st == Storage::BF16) x = bf16_round(x), u = bf16_round(u), dy = bf16_round(dy);
  std::vector<float> y = zeros(n), dx = zeros(n);
  gelu_tanh_forward(x.data(), y.data(), n);
  gelu_tanh_backward(x.data(), dy.data(), dx.data(), n);
  Buffer gx = up(x, st), gu = up(u, st), gdy = up(dy, st), gy(size_t(n) * esize(st)), gdx(size_t(n) * esize(st)),
         gdu(size_t(n) * esize(st));
  cuda::gelu_tanh_forward(gx.get(), gy.get(), n, st);
  cuda::gelu_tanh_backward(gx.get(), gdy.get(), gdx.get(), n, st);
  EXPECT_LE(rel(down(gy, n, st), y), tol(st));
  EXPECT_LE(rel(down(gdx, n, st), dx), tol(st));
  for (const SituOptions o : {SituOptions{}, SituOptions::silu()}) {
    std::vector<float> sy = zeros(n), sdg = zeros(n), sdu = zeros(n);
    for (int64_t i = 0; i < n; ++i) {
      sy[size_t(i)] = situ_gate(x[size_t(i)], o.beta) * situ_up(u[size_t(i)], o.beta_lin);
      sdg[size_t(i)] = dy[size_t(i)] * situ_gate_grad(x[size_t(i)], o.beta) * situ_up(u[size_t(i)], o.beta_lin);
      sdu[size_t(i)] = dy[size_t(i)] * situ_gate(x[size_t(i)], o.beta) * situ_up_grad(u[size_t(i)], o.beta_lin);
    }
    const float beta = o.beta.value_or(0.0f), bl = o.beta_lin.value_or(0.0f);
    cuda::situ_glu_forward(gx.get(), gu.get(), gy.get(), n, beta, bl, st);
    cuda::situ_glu_backward(gx.get(), gu.get(), gdy.get(), gdx.get(), gdu.get(), n, beta, bl, st);
    EXPECT_LE(rel(down(gy, n, st), sy), tol(st)) << "situ beta " << beta;
    EXPECT_LE(rel(down(gdx, n, st), sdg), tol(st)) << "situ dgate beta " << beta;
    EXPECT_LE(rel(down(gdu, n, st), sdu), tol(st)) << "situ dup beta " << beta;
  }
}

// The fused producers of a GEMM's or the attention's operands (GPT-2's training step): fp32 in,
// the output stored as the parameter's storage, against the CPU's ops composed: the norm of fp32
// rows, the q/k/v split with the projection's bias, the MLP's bias then GELU (the biased
// pre-activation written back in fp32); and the backward's fp32 results with their bf16 copies
// (the GELU's backward, the q/k/v merge). D 128 takes the warp-per-row norm and the four-column
// kernels, D 95 (and F = 4·95 + 1) the others.
TEST_P(OpsCuda, FusedProducersMatchTheComposedOps) {
  const Storage st = GetParam();
  Rng rng(12);
  for (const int64_t D : {128, 95}) {
    const int64_t M = 75, F = 4 * D + D % 2;
    const std::string label = "D " + std::to_string(D);
    const auto x = randv(rng, M * D), w = randv(rng, D), b = randv(rng, D), qkv = randv(rng, M * 3 * D),
               bq = randv(rng, 3 * D), ff = randv(rng, M * F, 2.0f), bf = randv(rng, F), dy = randv(rng, M * F);
    std::vector<float> y = zeros(M * D), mean = zeros(M), rstd = zeros(M);
    layernorm_forward(x.data(), w.data(), b.data(), 1e-5f, M, D, y.data(), mean.data(), rstd.data());
    Buffer gx = up(x), gw = up(w), gb = up(b), gy(size_t(M * D) * esize(st)), gm(size_t(M) * 4), gr(size_t(M) * 4);
    cuda::layernorm_forward_to(gx.as<float>(), gw.as<float>(), gb.as<float>(), 1e-5f, M, D, gy.get(), st,
                               gm.as<float>(), gr.as<float>());
    EXPECT_LE(rel(down(gy, M * D, st), y), tol(st)) << label << " layernorm y";
    EXPECT_LE(rel(down(gm, M), mean), 1e-5) << label << " layernorm mean";
    EXPECT_LE(rel(down(gr, M), rstd), 1e-5) << label << " layernorm rstd";

    std::vector<float> parts[3] = {zeros(M * D), zeros(M * D), zeros(M * D)};
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < 3 * D; ++c)
        parts[c / D][size_t(m * D + c % D)] = qkv[size_t(m * 3 * D + c)] + bq[size_t(c)];
    Buffer gqkv = up(qkv), gbq = up(bq), gq(size_t(M * D) * esize(st)), gk(size_t(M * D) * esize(st)),
           gv(size_t(M * D) * esize(st));
    cuda::split_qkv_to(gqkv.as<float>(), gbq.as<float>(), gq.get(), gk.get(), gv.get(), M, D, st);
    // Exact in fp32; one rounding in bf16.
    const double round_tol = st == Storage::BF16 ? 4e-3 : 0.0;
    EXPECT_LE(rel(down(gq, M * D, st), parts[0]), round_tol) << label << " q";
    EXPECT_LE(rel(down(gk, M * D, st), parts[1]), round_tol) << label << " k";
    EXPECT_LE(rel(down(gv, M * D, st), parts[2]), round_tol) << label << " v";

    std::vector<float> pre = ff, act = zeros(M * F), dpre = zeros(M * F);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < F; ++n) pre[size_t(m * F + n)] += bf[size_t(n)];
    gelu_tanh_forward(pre.data(), act.data(), M * F);
    gelu_tanh_backward(pre.data(), dy.data(), dpre.data(), M * F);
    Buffer gff = up(ff), gbf = up(bf), gact(size_t(M * F) * esize(st));
    cuda::bias_gelu_tanh_to(gff.as<float>(), gbf.as<float>(), gact.get(), M, F, st);
    EXPECT_LE(rel(down(gff, M * F), pre), 0.0) << label << " pre-activation";
    EXPECT_LE(rel(down(gact, M * F, st), act), tol(st)) << label << " gelu";

    if (st != Storage::BF16) continue;  // the backward's copies: fp32 results with bf16 beside them
    Buffer gdy = up(dy), gdpre(size_t(M * F) * 4), gdpre_b(size_t(M * F) * 2);
    cuda::gelu_tanh_backward(gff.get(), gdy.get(), gdpre.get(), M * F, Storage::F32, gdpre_b.get());
    const std::vector<float> got_dpre = down(gdpre, M * F);
    EXPECT_LE(rel(got_dpre, dpre), 1e-4) << label << " gelu backward";
    EXPECT_EQ(down(gdpre_b, M * F, Storage::BF16), bf16_round(got_dpre)) << label << " gelu backward's bf16 copy";
    // With the bias gradient in the same pass, into one that already holds values (it adds): the
    // bf16 copy alone, then the fp32 result alone. F = 512 takes the one kernel, 381 the composed ops.
    const auto dbias0 = randv(rng, F);
    std::vector<double> colsum(static_cast<size_t>(F), 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < F; ++n) colsum[size_t(n)] += dpre[size_t(m * F + n)];
    std::vector<float> dbias_ref = dbias0;
    for (int64_t n = 0; n < F; ++n) dbias_ref[size_t(n)] += float(colsum[size_t(n)]);
    Buffer gdbias = up(dbias0), gdpre_b2(size_t(M * F) * 2);
    cuda::gelu_tanh_backward_bias(gff.as<float>(), gdy.as<float>(), M, F, nullptr, gdpre_b2.get(), gdbias.as<float>());
    EXPECT_EQ(down(gdpre_b2, M * F, Storage::BF16), bf16_round(got_dpre)) << label << " fused: the bf16 copy";
    EXPECT_LE(rel(down(gdbias, F), dbias_ref), 1e-5) << label << " fused: the bias gradient";
    Buffer gdbias2 = up(dbias0), gdpre2(size_t(M * F) * 4);
    cuda::gelu_tanh_backward_bias(gff.as<float>(), gdy.as<float>(), M, F, gdpre2.as<float>(), nullptr,
                                  gdbias2.as<float>());
    EXPECT_EQ(down(gdpre2, M * F), got_dpre) << label << " fused: the fp32 result";
    EXPECT_LE(rel(down(gdbias2, F), dbias_ref), 1e-5) << label << " fused: the bias gradient (fp32 result)";
    std::vector<float> merged = zeros(M * 3 * D);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < 3 * D; ++c) merged[size_t(m * 3 * D + c)] = parts[c / D][size_t(m * D + c % D)];
    Buffer p0 = up(parts[0]), p1 = up(parts[1]), p2 = up(parts[2]), gmerged(size_t(M * 3 * D) * 4),
           gmerged_b(size_t(M * 3 * D) * 2);
    cuda::merge_qkv(p0.as<float>(), p1.as<float>(), p2.as<float>(), gmerged.as<float>(), M, D, gmerged_b.get());
    EXPECT_EQ(down(gmerged, M * 3 * D), merged) << label << " merge";
    EXPECT_EQ(down(gmerged_b, M * 3 * D, Storage::BF16), bf16_round(merged)) << label << " merge's bf16 copy";
    // The merge with the bias gradient, into one that already holds values: D = 128 takes the one
    // kernel, 95 the composed ops.
    const auto qbias0 = randv(rng, 3 * D);
    std::vector<double> qsum(static_cast<size_t>(3 * D), 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < 3 * D; ++c) qsum[size_t(c)] += merged[size_t(m * 3 * D + c)];
    std::vector<float> qbias_ref = qbias0;
    for (int64_t c = 0; c < 3 * D; ++c) qbias_ref[size_t(c)] += float(qsum[size_t(c)]);
    Buffer gqbias = up(qbias0), gmerged_b2(size_t(M * 3 * D) * 2), gqbias2 = up(qbias0),
           gmerged2(size_t(M * 3 * D) * 4);
    cuda::merge_qkv_bias(p0.as<float>(), p1.as<float>(), p2.as<float>(), M, D, nullptr, gmerged_b2.get(),
                         gqbias.as<float>());
    EXPECT_EQ(down(gmerged_b2, M * 3 * D, Storage::BF16), bf16_round(merged)) << label << " fused merge: bf16 copy";
    EXPECT_LE(rel(down(gqbias, 3 * D), qbias_ref), 1e-5) << label << " fused merge: the bias gradient";
    cuda::merge_qkv_bias(p0.as<float>(), p1.as<float>(), p2.as<float>(), M, D, gmerged2.as<float>(), nullptr,
                         gqbias2.as<float>());
    EXPECT_EQ(down(gmerged2, M * 3 * D), merged) << label << " fused merge: the fp32 result";
    EXPECT_LE(rel(down(gqbias2, 3 * D), qbias_ref), 1e-5) << label << " fused merge: the bias gradient (fp32)";
  }
}

// The norm's backward into a residual stream's adjoint with its extras (GPT-2's step): dx added to
// what the array holds, its bf16 copy (the fp32 result rounded once) and its column sums added
// to a bias gradient, against the CPU's backward and sums. D 768 and 128 take the one kernel (M 75
// and 5001: ragged last row groups), D 95 the composed ops; without the copy and the sums too.
TEST(OpsCudaOnly, LayerNormBackwardIntoAResidualStream) {
  Rng rng(23);
  for (const auto& [D, M] : {std::pair<int64_t, int64_t>{768, 75}, {768, 5001}, {128, 75}, {95, 75}})
    for (const bool extras : {true, false})
      for (const Storage dy_st : {Storage::F32, Storage::BF16}) {  // dy as a bf16 GEMM writes it too
        const std::string label = "D " + std::to_string(D) + " M " + std::to_string(M) + (extras ? "" : " plain") +
                                  (dy_st == Storage::BF16 ? " bf16 dy" : "");
        auto dy = randv(rng, M * D);
        if (dy_st == Storage::BF16) dy = bf16_round(dy);
        const auto x = randv(rng, M * D), w = randv(rng, D), b = randv(rng, D),
                   dx0 = randv(rng, M * D), dw0 = randv(rng, D), db0 = randv(rng, D), ds0 = randv(rng, D);
        std::vector<float> y = zeros(M * D), mean = zeros(M), rstd = zeros(M), dx = zeros(M * D), dw = zeros(D),
                           db = zeros(D);
        layernorm_forward(x.data(), w.data(), b.data(), 1e-5f, M, D, y.data(), mean.data(), rstd.data());
        layernorm_backward(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), M, D, dx.data(), dw.data(),
                           db.data());
        std::vector<float> want_dx = dx0, want_dw = dw0, want_db = db0, want_ds = ds0;
        std::vector<double> colsum(static_cast<size_t>(D), 0.0);
        for (int64_t i = 0; i < M * D; ++i) {
          want_dx[size_t(i)] += dx[size_t(i)];
          colsum[size_t(i % D)] += want_dx[size_t(i)];
        }
        for (int64_t d = 0; d < D; ++d) {
          want_dw[size_t(d)] += dw[size_t(d)];
          want_db[size_t(d)] += db[size_t(d)];
          want_ds[size_t(d)] += float(colsum[size_t(d)]);
        }
        Buffer gx = up(x), gdy = up(dy, dy_st), gw = up(w), gm = up(mean), gr = up(rstd), gdx = up(dx0), gdw = up(dw0),
               gdb = up(db0), gds = up(ds0), gdxb(size_t(M * D) * 2);
        cuda::layernorm_backward_residual(gx.as<float>(), gw.as<float>(), gm.as<float>(), gr.as<float>(),
                                          gdy.get(), dy_st, M, D, gdx.as<float>(), extras ? gdxb.get() : nullptr,
                                          gdw.as<float>(), gdb.as<float>(), extras ? gds.as<float>() : nullptr,
                                          /*accumulate=*/true);
        const auto got_dx = down(gdx, M * D);
        EXPECT_LE(rel(got_dx, want_dx), 1e-5) << label << " dx";
        EXPECT_LE(rel(down(gdw, D), want_dw), 1e-5) << label << " dw";
        EXPECT_LE(rel(down(gdb, D), want_db), 1e-5) << label << " db";
        if (extras) {
          EXPECT_EQ(down(gdxb, M * D, Storage::BF16), bf16_round(got_dx)) << label << " dx's bf16 copy";
          EXPECT_LE(rel(down(gds, D), want_ds), 1e-5) << label << " dx's column sums";
        } else {
          EXPECT_EQ(down(gds, D), ds0) << label << " no sums asked: left as it was";
        }
      }
  // = rather than +=: dx's previous values do not count.
  const int64_t M = 9, D = 128;
  const auto x = randv(rng, M * D), dy = randv(rng, M * D), w = randv(rng, D), b = randv(rng, D);
  std::vector<float> y = zeros(M * D), mean = zeros(M), rstd = zeros(M), dx = zeros(M * D), dw = zeros(D),
                     db = zeros(D);
  layernorm_forward(x.data(), w.data(), b.data(), 1e-5f, M, D, y.data(), mean.data(), rstd.data());
  layernorm_backward(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), M, D, dx.data(), dw.data(), db.data());
  Buffer gx = up(x), gdy = up(dy), gw = up(w), gm = up(mean), gr = up(rstd), gdx = up(randv(rng, M * D)),
         gdw = up(zeros(D)), gdb = up(zeros(D));
  cuda::layernorm_backward_residual(gx.as<float>(), gw.as<float>(), gm.as<float>(), gr.as<float>(), gdy.get(),
                                    Storage::F32, M, D, gdx.as<float>(), nullptr, gdw.as<float>(), gdb.as<float>(), nullptr,
                                    /*accumulate=*/false);
  EXPECT_LE(rel(down(gdx, M * D), dx), 1e-5) << "overwrite";
}

// GPT-2's bf16 producers: the q/k/v split of a bf16 projection (exact), and the GELU's backward
// over a bf16 pre-activation and output gradient, dx as bf16 with the bias gradient added in the
// same pass (F 512: the one kernel; F 381: the widened composed path).
TEST(OpsCudaOnly, Bf16ProducersMatchTheComposedOps) {
  Rng rng(19);
  for (const int64_t D : {128, 95}) {
    const int64_t M = 75, F = 4 * D + D % 2;
    const std::string label = "D " + std::to_string(D);
    const auto qkv = bf16_round(randv(rng, M * 3 * D));
    std::vector<float> parts[3] = {zeros(M * D), zeros(M * D), zeros(M * D)};
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < 3 * D; ++c) parts[c / D][size_t(m * D + c % D)] = qkv[size_t(m * 3 * D + c)];
    Buffer gqkv = up(qkv, Storage::BF16), gq(size_t(M * D) * 2), gk(size_t(M * D) * 2), gv(size_t(M * D) * 2);
    cuda::split_qkv_bf16(gqkv.get(), gq.get(), gk.get(), gv.get(), M, D);
    EXPECT_EQ(down(gq, M * D, Storage::BF16), parts[0]) << label << " q";
    EXPECT_EQ(down(gk, M * D, Storage::BF16), parts[1]) << label << " k";
    EXPECT_EQ(down(gv, M * D, Storage::BF16), parts[2]) << label << " v";

    const auto pre = bf16_round(randv(rng, M * F, 2.0f)), dy = bf16_round(randv(rng, M * F)), dbias0 = randv(rng, F);
    std::vector<float> dpre = zeros(M * F);
    gelu_tanh_backward(pre.data(), dy.data(), dpre.data(), M * F);
    std::vector<double> colsum(static_cast<size_t>(F), 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < F; ++n) colsum[size_t(n)] += dpre[size_t(m * F + n)];
    std::vector<float> dbias_ref = dbias0;
    for (int64_t n = 0; n < F; ++n) dbias_ref[size_t(n)] += float(colsum[size_t(n)]);
    Buffer gpre = up(pre, Storage::BF16), gdy = up(dy, Storage::BF16), gdx(size_t(M * F) * 2), gdb = up(dbias0);
    cuda::gelu_tanh_backward_bias_bf16(gpre.get(), gdy.get(), M, F, gdx.get(), gdb.as<float>());
    EXPECT_LE(rel(down(gdx, M * F, Storage::BF16), dpre), 4e-3) << label << " gelu backward (bf16)";
    EXPECT_LE(rel(down(gdb, F), dbias_ref), 1e-5) << label << " gelu backward's bias gradient (bf16 inputs)";
    // The forward bf16 to bf16 (M·F a multiple of 4 at D 128: four values a thread).
    std::vector<float> act = zeros(M * F);
    gelu_tanh_forward(pre.data(), act.data(), M * F);
    Buffer gact(size_t(M * F) * 2);
    cuda::gelu_tanh_forward(gpre.get(), gact.get(), M * F, Storage::BF16);
    EXPECT_LE(rel(down(gact, M * F, Storage::BF16), act), 4e-3) << label << " gelu forward (bf16)";
  }
}

TEST_P(OpsCuda, EmbeddingAndRope) {
  const Storage st = GetParam();
  Rng rng(3);
  const int64_t vocab = 50, D = 64, n = 40, H = 4, hd = 16;
  auto table = randv(rng, vocab * D);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (auto& i : ids) i = int64_t(rng.uniform() * vocab) % vocab;
  Tensor tt = Tensor::from_vector(table, {vocab, D});
  std::vector<float> y = zeros(n * D);
  embedding_forward(tt, ids.data(), n, y.data());
  Buffer gt = up(table), gids = device::upload_new(ids.data(), ids.size() * 8), gy(size_t(n * D) * esize(st));
  cuda::embedding_forward(gt.as<float>(), vocab, gids.as<int64_t>(), n, D, gy.get(), st);
  EXPECT_LE(rel(down(gy, n * D, st), st == Storage::BF16 ? bf16_round(y) : y), 1e-6);
  // Backward: scatter-add; repeated ids accumulate.
  auto dy = randv(rng, n * D);
  if (st == Storage::BF16) dy = bf16_round(dy);
  std::vector<float> dt = zeros(vocab * D);
  embedding_backward(ids.data(), n, D, dy.data(), dt.data());
  Buffer gdy = up(dy, st), gdt = device::zeros_f32(vocab * D);
  cuda::embedding_backward(gids.as<int64_t>(), n, D, gdy.get(), gdt.as<float>(), st);
  EXPECT_LE(rel(down(gdt, vocab * D), dt), 1e-5);
  // Out-of-range ids: a clear error.
  std::vector<int64_t> bad = {0, vocab};
  Buffer gbad = device::upload_new(bad.data(), 16);
  EXPECT_THROW(cuda::embedding_forward(gt.as<float>(), vocab, gbad.as<int64_t>(), 2, D, gy.get(), st), Error);

  // RoPE with YaRN at large positions (angles in double), forward and inverse.
  YarnScaling yarn;
  yarn.factor = 32.0;
  RopeTable rt = make_rope(8, 10000.0, yarn);
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t m = 0; m < n; ++m) pos[size_t(m)] = m * 25000 + 3;
  auto x = randv(rng, n * H * hd);
  if (st == Storage::BF16) x = bf16_round(x);
  for (bool half : {false, true})  // adjacent pairs (DeepSeek) and rotate-half (Qwen)
    for (int dir : {1, -1}) {
      rt.half_pairs = half;
      std::vector<float> ref = x;
      rope_apply(ref.data(), n, H, hd, 4, pos.data(), rt, dir);
      Buffer gx = up(x, st), gpos = device::upload_new(pos.data(), pos.size() * 8),
             gf = device::upload_new(rt.inv_freq.data(), rt.inv_freq.size() * 8);
      cuda::rope_apply(gx.get(), n, H, hd, 4, rt.dim, gpos.as<int64_t>(), gf.as<double>(), rt.attention_factor, dir,
                       st, half);
      EXPECT_LE(rel(down(gx, n * H * hd, st), ref), tol(st)) << "rope direction " << dir << " half pairs " << half;
    }
}

// Flash-style attention against the CPU's direct softmax: prefill (pos0 = 0), a chunk after a
// cached prefix (pos0 > 0), the decode step (Tq = 1), head dims up to 192 with hdv ≠ hd (MLA).
TEST_P(OpsCuda, CausalAttentionForwardBackward) {
  const Storage st = GetParam();
  Rng rng(8);
  struct Case {
    int64_t Tq, pos0, hd, hdv;
  };
  // bf16 storage at hd 64 / 128 / 192-128 runs the tensor-core forward (wgmma, 128-query blocks,
  // 128-key tiles, 80 at hd 192, 64 at hd 64 up to 2,048 keys, in a 3- or 4-stage ring filled by
  // tensor copies) and at 64 / 128 the tensor-core backward (64-key blocks, 64- or 32-query
  // tiles): the longer cases walk several tiles, the longest refill every stage of the ring, with
  // pos0 off the tile grid; 2,100 keys at hd 64 take the 128-key tiles.
  for (const Case c : {Case{1, 0, 64, 64}, Case{63, 0, 64, 64}, Case{65, 7, 128, 128}, Case{130, 0, 32, 48},
                       Case{1, 99, 128, 128}, Case{40, 3, 192, 128}, Case{300, 0, 128, 128}, Case{200, 37, 64, 64},
                       Case{150, 70, 192, 128}, Case{700, 45, 128, 128}, Case{600, 0, 64, 64},
                       Case{330, 200, 192, 128}, Case{2000, 100, 64, 64}}) {
    const int64_t B = 2, H = 3, S = c.pos0 + c.Tq;
    const float scale = 1.0f / std::sqrt(float(c.hd));
    auto q = randv(rng, B * c.Tq * H * c.hd), k = randv(rng, B * S * H * c.hd), v = randv(rng, B * S * H * c.hdv),
         dy = randv(rng, B * c.Tq * H * c.hdv);
    if (st == Storage::BF16) q = bf16_round(q), k = bf16_round(k), v = bf16_round(v), dy = bf16_round(dy);
    // CPU, one sequence at a time ([T, H, d] views of the batched buffers).
    std::vector<float> y = zeros(B * c.Tq * H * c.hdv), dq = zeros(B * c.Tq * H * c.hd), dk = zeros(B * S * H * c.hd),
                       dv = zeros(B * S * H * c.hdv);
    for (int64_t b = 0; b < B; ++b) {
      const AttentionShape as{c.Tq, S, H, c.hd, c.pos0, scale, c.hdv};
      auto view = [&](std::vector<float>& buf, int64_t T, int64_t d) {
        return HeadView{buf.data() + b * T * H * d, H * d, d};
      };
      std::vector<float> probs = zeros(H * c.Tq * S);
      attention_forward(view(q, c.Tq, c.hd), view(k, S, c.hd), view(v, S, c.hdv), view(y, c.Tq, c.hdv), as,
                        probs.data());
      attention_backward(view(q, c.Tq, c.hd), view(k, S, c.hd), view(v, S, c.hdv), probs.data(),
                         view(dy, c.Tq, c.hdv), view(dq, c.Tq, c.hd), view(dk, S, c.hd), view(dv, S, c.hdv), as);
    }
    const cuda::AttnShape a{B, c.Tq, S, H, c.hd, c.hdv, c.pos0, scale};
    Buffer gq = up(q, st), gk = up(k, st), gv = up(v, st), gdy = up(dy, st), gy(y.size() * esize(st)),
           glse(size_t(B * H * c.Tq) * 4), gdq = device::zeros_f32(int64_t(dq.size())),
           gdk = device::zeros_f32(int64_t(dk.size())), gdv = device::zeros_f32(int64_t(dv.size()));
    cuda::attention_forward(gq.get(), gk.get(), gv.get(), gy.get(), glse.as<float>(), a, st);
    // The backward takes y as stored; the CPU reference's y is fp32, so compare gradients with a
    // bf16 tolerance there.
    cuda::attention_backward(gq.get(), gk.get(), gv.get(), gy.get(), glse.as<float>(), gdy.get(), gdq.as<float>(),
                             gdk.as<float>(), gdv.as<float>(), a, st);
    const std::string label = "Tq " + std::to_string(c.Tq) + " pos0 " + std::to_string(c.pos0) + " hd " +
                              std::to_string(c.hd) + "/" + std::to_string(c.hdv);
    EXPECT_LE(rel(down(gy, int64_t(y.size()), st), y), tol(st)) << label << " y";
    EXPECT_LE(rel(down(gdq, int64_t(dq.size())), dq), tol(st)) << label << " dq";
    EXPECT_LE(rel(down(gdk, int64_t(dk.size())), dk), tol(st)) << label << " dk";
    EXPECT_LE(rel(down(gdv, int64_t(dv.size())), dv), tol(st)) << label << " dv";
    // accumulate_kv false: dk and dv written over whatever they held (7s here), dq still added.
    Buffer gdq2 = device::zeros_f32(int64_t(dq.size())), gdk2 = up(std::vector<float>(dk.size(), 7.0f)),
           gdv2 = up(std::vector<float>(dv.size(), 7.0f));
    cuda::attention_backward(gq.get(), gk.get(), gv.get(), gy.get(), glse.as<float>(), gdy.get(), gdq2.as<float>(),
                             gdk2.as<float>(), gdv2.as<float>(), a, st, /*accumulate_kv=*/false);
    EXPECT_LE(rel(down(gdq2, int64_t(dq.size())), dq), tol(st)) << label << " dq (dk, dv written over)";
    EXPECT_LE(rel(down(gdk2, int64_t(dk.size())), dk), tol(st)) << label << " dk written over";
    EXPECT_LE(rel(down(gdv2, int64_t(dv.size())), dv), tol(st)) << label << " dv written over";
  }
}

// Attention over q, k and v packed in one bf16 [B·T, 3·H·hd] array (a fused projection's output,
// read in place) against the CPU's direct softmax on the three column blocks: y, and the gradient
// written packed (over 7s) with its column sums added to a bias gradient that holds values. hd 64
// and 128 run the tensor-core kernels on strided rows (the gradients of k and v written as bf16
// rows by the backward, dq's cast after it); hd 32 and 80 the split/merge fallback.
TEST(OpsCudaOnly, PackedQkvAttentionMatchesTheCpu) {
  Rng rng(31);
  struct Case {
    int64_t B, T, H, hd;
    bool bias;
  };
  for (const Case c : {Case{2, 1, 3, 64, true}, Case{2, 63, 3, 64, true}, Case{1, 200, 2, 128, true},
                       Case{2, 700, 3, 64, true}, Case{2, 300, 2, 128, false}, Case{2, 130, 3, 32, true},
                       Case{1, 65, 3, 80, true}}) {
    const int64_t D = c.H * c.hd, M = c.B * c.T;
    const float scale = 1.0f / std::sqrt(float(c.hd));
    const auto qkv = bf16_round(randv(rng, M * 3 * D)), dy = bf16_round(randv(rng, M * D));
    const auto bias0 = randv(rng, 3 * D);
    std::vector<float> y = zeros(M * D), dqkv = zeros(M * 3 * D);
    std::vector<float> qkv_in = qkv;  // the CPU's views read it; its gradient goes to dqkv
    for (int64_t b = 0; b < c.B; ++b) {
      const AttentionShape as{c.T, c.T, c.H, c.hd, 0, scale, c.hd};
      auto block = [&](std::vector<float>& buf, int64_t i) {
        return HeadView{buf.data() + b * c.T * 3 * D + i * D, 3 * D, c.hd};
      };
      auto rows = [&](std::vector<float>& buf) { return HeadView{buf.data() + b * c.T * D, D, c.hd}; };
      std::vector<float> probs = zeros(c.H * c.T * c.T), dyv = dy;
      attention_forward(block(qkv_in, 0), block(qkv_in, 1), block(qkv_in, 2), rows(y), as, probs.data());
      attention_backward(block(qkv_in, 0), block(qkv_in, 1), block(qkv_in, 2), probs.data(), rows(dyv),
                         block(dqkv, 0), block(dqkv, 1), block(dqkv, 2), as);
    }
    std::vector<float> bias = bias0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < 3 * D; ++j) bias[size_t(j)] += dqkv[size_t(m * 3 * D + j)];
    const cuda::AttnShape a{c.B, c.T, c.T, c.H, c.hd, c.hd, 0, scale};
    Buffer gqkv = up(qkv, Storage::BF16), gdy = up(dy, Storage::BF16), gy(size_t(M * D) * 2),
           glse(size_t(c.B * c.H * c.T) * 4), gd = up(std::vector<float>(size_t(M * 3 * D), 7.0f), Storage::BF16),
           gbias = up(bias0);
    cuda::attention_forward_qkv(gqkv.get(), gy.get(), glse.as<float>(), a);
    cuda::attention_backward_qkv(gqkv.get(), gy.get(), glse.as<float>(), gdy.get(), gd.get(),
                                 c.bias ? gbias.as<float>() : nullptr, a);
    const std::string label = "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " hd " + std::to_string(c.hd);
    EXPECT_LE(rel(down(gy, M * D, Storage::BF16), y), 5e-3) << label << " y";
    EXPECT_LE(rel(down(gd, M * 3 * D, Storage::BF16), dqkv), 5e-3) << label << " dqkv";
    EXPECT_LE(rel(down(gbias, 3 * D), c.bias ? bias : bias0), 5e-3) << label << " bias gradient";
  }
  // Packed arrays hold one sequence length: a decode shape is refused.
  const cuda::AttnShape bad{1, 1, 5, 2, 64, 64, 4, 0.125f};
  Buffer g(size_t(5 * 3 * 128) * 2), gy(256 * 2);
  EXPECT_THROW(cuda::attention_forward_qkv(g.get(), gy.get(), nullptr, bad), Error);
}

// The decode-shaped attention over per-sequence caches (attention_cached) against the CPU's direct
// softmax, sequence by sequence: unequal lengths (one key to several thousand), 1–3 new queries,
// heads that fill the lanes (hd = hdv = 32·2, 32·4, 32·8: the cp.async ring) and others (80 / 48,
// 200 / 136, 32: registers), one split (≤ 64 keys: y written by the split kernel) and many, grids
// sized for the caches' capacity (as a captured step is), and one sequence's rows starting off
// the 16-byte alignment (the ring's plain-load copies, over many passes). Rows past each
// sequence's keys hold NaN: reading one would show.
TEST_P(OpsCuda, CachedAttentionOverPerSequenceRows) {
  const Storage st = GetParam();
  Rng rng(21);
  struct Case {
    int64_t H, hd, hdv, Tq;
    std::vector<int64_t> p0;
    int64_t cap;  // rows per cache; the grid is sized for it when `for_capacity`
    bool for_capacity;
  };
  const std::vector<Case> cases = {
      {12, 64, 64, 1, {0, 900, 1023, 5}, 1024, false},        {4, 128, 128, 3, {4094, 1700, 300}, 4100, false},
      {3, 80, 48, 2, {0, 250, 1999}, 2001, false},            {2, 256, 256, 1, {700, 650}, 701, false},
      {2, 200, 136, 1, {64, 129}, 130, false},                {6, 64, 64, 1, {5, 900, 31}, 6000, true},
      {16, 128, 128, 1, std::vector<int64_t>(40, 2047), 2048, false},
      {4, 64, 64, 1, {0, 20, 63}, 64, false},                 {5, 32, 32, 2, {3, 500}, 700, true},
      {8, 128, 128, 2, {100, 2000, 7}, 3000, true}};
  for (const Case& c : cases) {
    const int64_t B = int64_t(c.p0.size()), H = c.H, Tq = c.Tq, ldq = H * c.hd + 5;
    const float scale = 1.0f / std::sqrt(float(c.hd));
    auto q = randv(rng, B * Tq * ldq);
    if (st == Storage::BF16) q = bf16_round(q);
    std::vector<Buffer> kbuf, vbuf;
    std::vector<const void*> ks, vs;
    std::vector<float> y = zeros(B * Tq * H * c.hdv);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t S = c.p0[size_t(b)] + Tq, shift = b == 1 ? 1 : 0;  // sequence 1 starts one element in
      auto k = randv(rng, c.cap * H * c.hd + shift), v = randv(rng, c.cap * H * c.hdv + shift);
      if (st == Storage::BF16) k = bf16_round(k), v = bf16_round(v);
      std::fill(k.begin() + shift + S * H * c.hd, k.end(), NAN);
      std::fill(v.begin() + shift + S * H * c.hdv, v.end(), NAN);
      const AttentionShape as{Tq, S, H, c.hd, c.p0[size_t(b)], scale, c.hdv};
      std::vector<float> probs = zeros(H * Tq * S);
      attention_forward(HeadView{q.data() + b * Tq * ldq, ldq, c.hd}, HeadView{k.data() + shift, H * c.hd, c.hd},
                        HeadView{v.data() + shift, H * c.hdv, c.hdv},
                        HeadView{y.data() + b * Tq * H * c.hdv, H * c.hdv, c.hdv}, as, probs.data());
      kbuf.push_back(up(k, st)), vbuf.push_back(up(v, st));
      ks.push_back(static_cast<const char*>(kbuf.back().get()) + shift * esize(st));
      vs.push_back(static_cast<const char*>(vbuf.back().get()) + shift * esize(st));
    }
    int64_t longest = c.cap;
    if (!c.for_capacity) longest = *std::max_element(c.p0.begin(), c.p0.end()) + Tq;
    Buffer gq = up(q, st), gy(y.size() * esize(st)), gks = device::upload_new(ks.data(), ks.size() * sizeof(void*)),
           gvs = device::upload_new(vs.data(), vs.size() * sizeof(void*)),
           gp0 = device::upload_new(c.p0.data(), c.p0.size() * 8);
    cuda::attention_cached(gq.get(), ldq, gks.as<const void* const>(), gvs.as<const void* const>(), gp0.as<int64_t>(),
                           longest, gy.get(), B, Tq, H, c.hd, c.hdv, scale, st);
    EXPECT_LE(rel(down(gy, int64_t(y.size()), st), y), tol(st))
        << "B " << B << " H " << H << " hd " << c.hd << "/" << c.hdv << " Tq " << Tq << " longest " << longest;
  }
  Buffer dummy(64);
  EXPECT_THROW(cuda::attention_cached(dummy.get(), 1, nullptr, nullptr, nullptr, 4, dummy.get(), 1, 1, 1, 300, 64, 1.0f,
                                      st),
               Error);
}

INSTANTIATE_TEST_SUITE_P(Storage, OpsCuda, ::testing::Values(Storage::F32, Storage::BF16),
                         [](const ::testing::TestParamInfo<Storage>& p) {
                           return std::string(p.param == Storage::BF16 ? "bf16" : "f32");
                         });

TEST(OpsCudaOnly, GatesForwardBackward) {
  Rng rng(4);
  const GateShape s{33, 4, 32};
  const int64_t n = s.rows * s.H * s.K;
  auto x = randv(rng, n, 2.0f), A = randv(rng, s.H, 0.5f), b = randv(rng, s.H * s.K), dg = randv(rng, n);
  Buffer gx = up(x), gA = up(A), gb = up(b), gdg = up(dg), gg(size_t(n) * 4);
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<float> g = zeros(n), dx = zeros(n), dA = zeros(s.H), db = zeros(s.H * s.K);
    Buffer gdx = device::zeros_f32(n), gdA = device::zeros_f32(s.H), gdb = device::zeros_f32(s.H * s.K);
    if (kind == 0) {
      gate_softplus_forward(x.data(), A.data(), b.data(), g.data(), s);
      gate_softplus_backward(x.data(), A.data(), b.data(), dg.data(), dx.data(), dA.data(), db.data(), s);
      cuda::gate_softplus_forward(gx.as<float>(), gA.as<float>(), gb.as<float>(), gg.as<float>(), s);
      cuda::gate_softplus_backward(gx.as<float>(), gA.as<float>(), gb.as<float>(), gdg.as<float>(), gdx.as<float>(),
                                   gdA.as<float>(), gdb.as<float>(), s);
    } else {
      gate_lowerbound_forward(x.data(), A.data(), b.data(), -5.0f, g.data(), s);
      gate_lowerbound_backward(x.data(), A.data(), b.data(), -5.0f, dg.data(), dx.data(), dA.data(), db.data(), s);
      cuda::gate_lowerbound_forward(gx.as<float>(), gA.as<float>(), gb.as<float>(), -5.0f, gg.as<float>(), s);
      cuda::gate_lowerbound_backward(gx.as<float>(), gA.as<float>(), gb.as<float>(), -5.0f, gdg.as<float>(),
                                     gdx.as<float>(), gdA.as<float>(), gdb.as<float>(), s);
    }
    EXPECT_LE(rel(down(gg, n), g), 1e-5) << kind;
    EXPECT_LE(rel(down(gdx, n), dx), 1e-5) << kind;
    EXPECT_LE(rel(down(gdA, s.H), dA), 1e-4) << kind;
    EXPECT_LE(rel(down(gdb, s.H * s.K), db), 1e-4) << kind;
  }
}

// fp32 → bf16 (round to nearest even, as the host's round_to_bf16) and back: lengths that take
// the four-wide kernel and one that does not, and a misaligned start.
TEST(OpsCudaOnly, CastRoundsAsTheHostAndWidensExactly) {
  Rng rng(7);
  for (const int64_t n : {int64_t(4096), int64_t(1001)}) {
    const auto x = randv(rng, n + 1, 3.0f);
    const std::vector<float> want = bf16_round(x);
    Buffer gx = up(x);
    for (const int64_t off : {int64_t(0), int64_t(1)}) {
      Buffer gb(size_t(n) * 2), gw(size_t(n) * 4);
      cuda::cast(gx.as<float>() + off, gb.get(), n, Storage::BF16);
      cuda::widen(gb.get(), gw.as<float>(), n, Storage::BF16);
      const std::vector<float> got = down(gw, n);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + off)) << "n " << n << " offset " << off;
    }
  }
}

// Column sums added into db: shapes with one row slice, several, and a ragged last column block.
TEST(OpsCudaOnly, BiasGradSumsEveryRow) {
  Rng rng(6);
  for (const auto& [M, N] : {std::pair<int64_t, int64_t>{14, 40}, {8192, 77}, {3001, 768}}) {
    const auto dy = randv(rng, M * N), db0 = randv(rng, N);
    std::vector<float> want = db0;
    for (int64_t n = 0; n < N; ++n) {
      double acc = db0[size_t(n)];
      for (int64_t m = 0; m < M; ++m) acc += dy[size_t(m * N + n)];
      want[size_t(n)] = float(acc);
    }
    Buffer gdy = up(dy), gdb = up(db0);
    cuda::bias_grad(gdy.as<float>(), gdb.as<float>(), M, N);
    EXPECT_LE(rel(down(gdb, N), want), 1e-5) << M << " x " << N;
  }
}

// Greedy picks on the device against std::max_element (the first of the largest) over rows with
// ties, −∞, NaNs (never picked) and one value; vocabularies of 1, 50 and Kimi's 163,840.
TEST(OpsCudaOnly, ArgmaxRowsPicksTheFirstLargest) {
  Rng rng(8);
  for (const auto& [M, N] : {std::pair<int64_t, int64_t>{5, 1}, {70, 50}, {64, 163840}}) {
    auto x = randv(rng, M * N);
    for (int64_t m = 0; m < M; ++m) {
      float* row = x.data() + m * N;
      if (m % 3 == 1 && N > 4) row[N - 2] = row[3] = 9.0f;  // a tie: the earlier wins
      if (m % 3 == 2) std::fill(row, row + N, -INFINITY), row[N - 1] = -1.0f;
      if (m % 5 == 4 && N > 4) row[0] = NAN;  // never the pick
    }
    std::vector<int64_t> want(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) {
      const float* row = x.data() + m * N;
      int64_t best = -1;
      for (int64_t i = 0; i < N; ++i)
        if (row[i] == row[i] && (best < 0 || row[i] > row[best])) best = i;
      want[size_t(m)] = best < 0 ? 0 : best;
      if (m % 5 != 4 || N <= 4) {
        EXPECT_EQ(want[size_t(m)], std::max_element(row, row + N) - row) << m;
      }
    }
    Buffer gx = up(x), gi(size_t(M) * sizeof(int64_t));
    cuda::argmax_rows(gx.as<float>(), M, N, gi.as<int64_t>());
    std::vector<int64_t> got(static_cast<size_t>(M));
    device::download(got.data(), gi.get(), got.size() * sizeof(int64_t));
    EXPECT_EQ(got, want) << M << " x " << N;
  }
}

// Rows of whole float4s (V 5000), padded rows whose last vector straddles the vocabulary's end
// (V 5001 in rows of 5004; V 4999 in rows of 5012, with whole vectors of pad columns past it: the
// pad columns' gradient must be written as zero) and rows of odd length (the scalar path); the
// gradient in place of fp32 logits and stored as bf16 (one rounding; the output array starts as
// 7s, so a column left unwritten shows); and over bf16 logits (a bf16 GEMM's output) in place:
// rows read once into shared memory (ld a multiple of 8 up to 65,536: V 5000, GPT-2's 50,257 in
// rows of 50,304), the two-pass kernel past that (V 70,000) and for the other rows.
TEST(OpsCudaOnly, CrossEntropyMatchesClosedForm) {
  Rng rng(5);
  const int64_t M = 19;
  for (const auto& [V, ld] :
       {std::pair<int64_t, int64_t>{5000, 5000}, {5001, 5004}, {4999, 5012}, {4999, 5003}, {50257, 50304},
        {70000, 70000}}) {
    auto z = randv(rng, M * ld, 4.0f);
    std::vector<int64_t> t(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) t[size_t(m)] = m == 3 ? -1 : (m * 977) % V;
    t[5] = V - 1;  // the last column, in the straddling vector
    const float scale = 1.0f / float(M);
    // The closed form over logits zz: loss per row and dlogits (pad columns zero).
    auto reference = [&](const std::vector<float>& zz, float c, std::vector<float>& loss, std::vector<float>& dz) {
      loss = zeros(M), dz = zeros(M * ld);
      for (int64_t m = 0; m < M; ++m) {
        const float* zr = zz.data() + m * ld;
        double mx = -INFINITY, s = 0.0;
        for (int64_t j = 0; j < V; ++j) mx = std::max(mx, double(zr[j]));
        for (int64_t j = 0; j < V; ++j) s += std::exp(double(zr[j]) - mx);
        const double lse = mx + std::log(s);
        const int64_t tm = t[size_t(m)];
        loss[size_t(m)] = tm < 0 ? 0.0f : float(lse - zr[tm] + c * lse * lse);
        for (int64_t j = 0; j < V; ++j)
          dz[size_t(m * ld + j)] =
              tm < 0 ? 0.0f
                     : float(((1.0 + 2.0 * c * lse) * std::exp(double(zr[j]) - lse) - (j == tm ? 1.0 : 0.0)) * scale);
      }
    };
    for (float c : {0.0f, 1e-3f, 0.05f}) {  // z-loss coefficient: loss + c·lse², dz·(1 + 2c·lse) on the softmax
      std::vector<float> loss, dz;
      reference(z, c, loss, dz);
      const std::string label = "V " + std::to_string(V) + " ld " + std::to_string(ld) + " z-loss " + std::to_string(c);
      Buffer gt = device::upload_new(t.data(), t.size() * 8);
      {  // fp32, in place
        Buffer gz = up(z), gl(size_t(M) * 4);
        cuda::cross_entropy(gz.as<float>(), gt.as<int64_t>(), M, V, gl.as<float>(), gz.as<float>(), scale, c, ld);
        EXPECT_LE(rel(down(gl, M), loss), 1e-5) << label;
        EXPECT_LE(rel(down(gz, M * ld), dz), 1e-5) << label;
      }
      {  // bf16, a separate array
        Buffer gz = up(z), gl(size_t(M) * 4), gd = up(std::vector<float>(size_t(M * ld), 7.0f), Storage::BF16);
        cuda::cross_entropy_to(gz.as<float>(), gt.as<int64_t>(), M, V, gl.as<float>(), gd.get(), Storage::BF16,
                               scale, c, ld);
        EXPECT_LE(rel(down(gl, M), loss), 1e-5) << label << " bf16";
        EXPECT_LE(rel(down(gd, M * ld, Storage::BF16), dz), 4e-3) << label << " bf16";
        EXPECT_EQ(down(gz, M * ld), z) << label << " bf16: the logits are left as they were";
      }
      {  // bf16 logits (a bf16 GEMM's output), dlogits in their place: the closed form on the rounded logits
        const auto zb = bf16_round(z);
        std::vector<float> loss_b, dz_b;
        reference(zb, c, loss_b, dz_b);
        Buffer gz = up(zb, Storage::BF16), gl(size_t(M) * 4);
        cuda::cross_entropy_bf16(gz.get(), gt.as<int64_t>(), M, V, gl.as<float>(), gz.get(), scale, c, ld);
        EXPECT_LE(rel(down(gl, M), loss_b), 1e-5) << label << " bf16 logits";
        EXPECT_LE(rel(down(gz, M * ld, Storage::BF16), dz_b), 4e-3) << label << " bf16 logits";
      }
    }
  }
}

TEST(OpsCudaOnly, AdamWMatchesClosedForm) {
  Rng rng(6);
  const int64_t n = 4097;
  auto w = randv(rng, n), g = randv(rng, n);
  std::vector<float> m = zeros(n), v = zeros(n);
  Buffer gw = up(w), gg = up(g), gm = device::zeros_f32(n), gv = device::zeros_f32(n);
  const cuda::AdamWStep base{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0};
  for (int64_t step = 1; step <= 3; ++step) {
    cuda::AdamWStep s = base;
    s.step = step;
    cuda::adamw(gw.as<float>(), gg.as<float>(), gm.as<float>(), gv.as<float>(), n, s);
    const double c1 = 1 - std::pow(0.9, double(step)), c2 = 1 - std::pow(0.95, double(step));
    for (size_t i = 0; i < size_t(n); ++i) {
      m[i] = 0.9f * m[i] + 0.1f * g[i];
      v[i] = 0.95f * v[i] + 0.05f * g[i] * g[i];
      w[i] -= float(1e-2 * (m[i] / c1 / (std::sqrt(v[i] / c2) + 1e-8) + 0.1 * w[i]));
    }
  }
  EXPECT_LE(rel(down(gw, n), w), 1e-6);
}

// The one-launch group: tensors of one to three chunks and a tiny one, each with its own weight
// decay, against the closed form per tensor.
TEST(OpsCudaOnly, AdamWGroupStepsEveryTensorAsItsOwnAdamW) {
  Rng rng(16);
  struct Shape {
    int64_t n;
    float wd;
    int64_t shift;  // the parameters start this many values into their array: 1 leaves the vector path
  };
  const std::vector<Shape> shapes = {{4097, 0.1f, 0}, {5, 0.0f, 0}, {9000, 0.05f, 0}, {4103, 0.02f, 1}};
  std::vector<std::vector<float>> w, g, m, v;
  std::vector<Buffer> gw, gg, gm, gv;
  std::vector<cuda::AdamWTensor> tensors;
  for (const auto& [n, wd, shift] : shapes) {
    w.push_back(randv(rng, n)), g.push_back(randv(rng, n)), m.push_back(zeros(n)), v.push_back(zeros(n));
    std::vector<float> padded = zeros(shift);
    padded.insert(padded.end(), w.back().begin(), w.back().end());
    gw.push_back(up(padded)), gg.push_back(up(g.back())), gm.push_back(device::zeros_f32(n));
    gv.push_back(device::zeros_f32(n));
    tensors.push_back({gw.back().as<float>() + shift, gg.back().as<float>(), gm.back().as<float>(),
                       gv.back().as<float>(), n, wd});
  }
  // bf16 copies of the updated parameters for two of them (a vector-path tensor and the shifted one).
  std::vector<Buffer> gcopy;
  for (size_t t : {size_t(0), size_t(3)}) {
    gcopy.emplace_back(size_t(shapes[t].n) * 2);
    tensors[t].param_bf16 = gcopy.back().get();
  }
  const cuda::AdamWGroup group(tensors);
  for (int64_t step = 1; step <= 3; ++step) {
    group.step(cuda::AdamWStep{1e-2f, 0.9f, 0.95f, 1e-8f, 0.5f, step});  // its weight decay is not used
    const double c1 = 1 - std::pow(0.9, double(step)), c2 = 1 - std::pow(0.95, double(step));
    for (size_t t = 0; t < shapes.size(); ++t)
      for (size_t i = 0; i < size_t(shapes[t].n); ++i) {
        m[t][i] = 0.9f * m[t][i] + 0.1f * g[t][i];
        v[t][i] = 0.95f * v[t][i] + 0.05f * g[t][i] * g[t][i];
        w[t][i] -= float(1e-2 * (m[t][i] / c1 / (std::sqrt(v[t][i] / c2) + 1e-8) + shapes[t].wd * w[t][i]));
      }
  }
  for (size_t t = 0; t < shapes.size(); ++t) {
    const std::vector<float> got = down(gw[t], shapes[t].n + shapes[t].shift);
    if (shapes[t].shift) {
      EXPECT_EQ(got[0], 0.0f) << "tensor " << t << ": the value before it was written";
    }
    EXPECT_LE(rel(std::vector<float>(got.begin() + shapes[t].shift, got.end()), w[t]), 1e-6) << "tensor " << t;
    if (t == 0 || t == 3) {  // the copy: the parameters the step wrote, rounded to bf16
      EXPECT_EQ(down(gcopy[t == 0 ? 0 : 1], shapes[t].n, Storage::BF16),
                bf16_round(std::vector<float>(got.begin() + shapes[t].shift, got.end())))
          << "tensor " << t << ": its bf16 copy";
    }
  }
}

TEST(OpsCudaOnly, GemmAllTransposesF32AndBf16) {
  Rng rng(7);
  const int64_t M = 67, N = 45, K = 130;
  for (Storage st : {Storage::F32, Storage::BF16})
    for (cuda::Op ta : {cuda::Op::N, cuda::Op::T})
      for (cuda::Op tb : {cuda::Op::N, cuda::Op::T}) {
        auto A = randv(rng, M * K), B = randv(rng, K * N), C0 = randv(rng, M * N);
        if (st == Storage::BF16) A = bf16_round(A), B = bf16_round(B);
        std::vector<float> C = C0;
        gemm(ta == cuda::Op::T ? Trans::Yes : Trans::No, tb == cuda::Op::T ? Trans::Yes : Trans::No, M, N, K, 0.5f,
             A.data(), 0, B.data(), 0, 2.0f, C.data(), 0);
        Buffer gA = up(A, st), gB = up(B, st), gC = up(C0);
        cuda::gemm(ta, tb, M, N, K, 0.5f, gA.get(), 0, gB.get(), 0, 2.0f, gC.as<float>(), 0, st);
        EXPECT_LE(rel(down(gC, M * N), C), st == Storage::BF16 ? 1e-5 : 1e-5)
            << "ta " << int(ta) << " tb " << int(tb) << " bf16 " << (st == Storage::BF16);
        // The same product with a bias vector through the epilogue: C + bias on every row.
        const auto bias = randv(rng, N);
        Buffer gbias = up(bias), gC2 = up(C0);
        cuda::gemm(ta, tb, M, N, K, 0.5f, gA.get(), 0, gB.get(), 0, 2.0f, gC2.as<float>(), 0, st, gbias.as<float>());
        for (int64_t i = 0; i < M * N; ++i) C[size_t(i)] += bias[size_t(i % N)];
        EXPECT_LE(rel(down(gC2, M * N), C), 1e-5)
            << "with bias: ta " << int(ta) << " tb " << int(tb) << " bf16 " << (st == Storage::BF16);
      }
}

// gemm_out: the product written as bf16 (one rounding of the fp32 sum plus bias), and an fp32
// output whose beta addend is read from another array (left as it was). Every transpose, on
// GPT-2-like aligned extents and on odd ones.
TEST(OpsCudaOnly, GemmOutWritesBf16AndReadsItsAddendApart) {
  Rng rng(17);
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{70, 96, 64}, {33, 40, 24}})
    for (cuda::Op ta : {cuda::Op::N, cuda::Op::T})
      for (cuda::Op tb : {cuda::Op::N, cuda::Op::T}) {
        const auto A = bf16_round(randv(rng, M * K)), B = bf16_round(randv(rng, K * N)), bias = randv(rng, N),
                   X = randv(rng, M * N);
        std::vector<float> P = zeros(M * N);  // A B in fp32 on the host
        gemm(ta == cuda::Op::T ? Trans::Yes : Trans::No, tb == cuda::Op::T ? Trans::Yes : Trans::No, M, N, K, 1.0f,
             A.data(), 0, B.data(), 0, 0.0f, P.data(), 0);
        const std::string label = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) + " ta " +
                                  std::to_string(int(ta)) + " tb " + std::to_string(int(tb));
        Buffer gA = up(A, Storage::BF16), gB = up(B, Storage::BF16), gbias = up(bias), gX = up(X);
        // bf16 output without a bias, then with one: within one bf16 rounding of the host's
        // product (+ bias; the epilogue reads it rounded to bf16, inside the same tolerance).
        Buffer gD0(size_t(M * N) * 2);
        cuda::gemm_out(ta, tb, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 0.0f, cuda::GemmOut{gD0.get(), Storage::BF16},
                       0, Storage::BF16);
        EXPECT_LE(rel(down(gD0, M * N, Storage::BF16), P), 4e-3) << label << " bf16 output, no bias";
        std::vector<float> want = P;
        for (int64_t i = 0; i < M * N; ++i) want[size_t(i)] += bias[size_t(i % N)];
        Buffer gD = up(std::vector<float>(size_t(M * N), 7.0f), Storage::BF16);
        cuda::gemm_out(ta, tb, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 0.0f,
                       cuda::GemmOut{gD.get(), Storage::BF16, nullptr, gbias.as<float>()}, 0, Storage::BF16);
        const auto got = down(gD, M * N, Storage::BF16);
        EXPECT_LE(rel(got, want), 4e-3) << label << " bf16 output";
        EXPECT_GT(rel(got, want), 0.0) << label << " bf16 output: rounded, so not the fp32 sums";
        // fp32 output D = X + A B + bias with X read from its own array.
        Buffer gD2 = up(zeros(M * N));
        cuda::gemm_out(ta, tb, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 1.0f,
                       cuda::GemmOut{gD2.get(), Storage::F32, gX.get(), gbias.as<float>()}, 0, Storage::BF16);
        for (int64_t i = 0; i < M * N; ++i) want[size_t(i)] += X[size_t(i)];
        EXPECT_LE(rel(down(gD2, M * N), want), 1e-5) << label << " addend apart";
        EXPECT_EQ(down(gX, M * N), X) << label << " the addend is left as it was";
      }
  // fp32 operands cannot write bf16: a clear error.
  Buffer a = up(zeros(16)), d(size_t(16) * 2);
  EXPECT_THROW(cuda::gemm_out(cuda::Op::N, cuda::Op::N, 4, 4, 4, 1.0f, a.get(), 0, a.get(), 0, 0.0f,
                              cuda::GemmOut{d.get(), Storage::BF16}, 0, Storage::F32),
               Error);
}

// The GELU epilogues and column sums against the host: D = GELU(A B + bias) with the
// pre-activation in aux, D = A B ∘ GELU'(aux), and column sums added into a bias gradient that
// holds values. N = 96 and 3072 take cuBLASLt's epilogues, N = 20 the composed path (the
// epilogues want N % 8 = 0).
TEST(OpsCudaOnly, GemmGeluEpiloguesAndColumnSums) {
  Rng rng(41);
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{70, 96, 64}, {33, 20, 24}, {256, 3072, 128}}) {
    const std::string label = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
    const auto A = bf16_round(randv(rng, M * K)), B = bf16_round(randv(rng, K * N)), bias = randv(rng, N);
    std::vector<float> P = zeros(M * N);
    gemm(Trans::No, Trans::No, M, N, K, 1.0f, A.data(), 0, B.data(), 0, 0.0f, P.data(), 0);
    std::vector<float> pre = P, act = zeros(M * N);
    for (int64_t i = 0; i < M * N; ++i) pre[size_t(i)] += round_to_bf16(bias[size_t(i % N)]);
    gelu_tanh_forward(pre.data(), act.data(), M * N);
    Buffer gA = up(A, Storage::BF16), gB = up(B, Storage::BF16), gbias = up(bias), gD(size_t(M * N) * 2),
           gaux(size_t(M * N) * 2);
    cuda::GemmOut o{gD.get(), Storage::BF16, nullptr, gbias.as<float>()};
    o.epi = cuda::Epilogue::Gelu, o.aux = gaux.get();
    cuda::gemm_out(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 0.0f, o, 0, Storage::BF16);
    EXPECT_LE(rel(down(gaux, M * N, Storage::BF16), pre), 4e-3) << label << " pre-activation";
    const auto got = down(gD, M * N, Storage::BF16);
    EXPECT_LE(rel(got, act), 5e-3) << label << " GELU";
    // The tanh form, not erf's (they differ by up to 4e-4; over 786K values the bf16 rounding
    // averages out and the systematic difference shows).
    auto erf_gelu = [](float x) { return float(0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)))); };
    std::vector<float> act_erf = zeros(M * N), dpre_erf = zeros(M * N);
    for (int64_t i = 0; i < M * N; ++i) act_erf[size_t(i)] = erf_gelu(pre[size_t(i)]);
    if (M * N > 500000) {
      EXPECT_LT(rel(got, act), rel(got, act_erf)) << label << " GELU closer to erf's than tanh's";
    }
    // The gradient through the GELU at the stored (rounded) pre-activation.
    const auto aux = down(gaux, M * N, Storage::BF16);
    std::vector<float> dpre = zeros(M * N);
    gelu_tanh_backward(aux.data(), P.data(), dpre.data(), M * N);
    Buffer gG(size_t(M * N) * 2);
    cuda::GemmOut og{gG.get(), Storage::BF16};
    og.epi = cuda::Epilogue::GeluGrad, og.aux = gaux.get();
    cuda::gemm_out(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 0.0f, og, 0, Storage::BF16);
    const auto gotg = down(gG, M * N, Storage::BF16);
    EXPECT_LE(rel(gotg, dpre), 5e-3) << label << " GELU gradient";
    for (int64_t i = 0; i < M * N; ++i) {
      const double x = aux[size_t(i)], cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
      dpre_erf[size_t(i)] = float(P[size_t(i)] * (cdf + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI)));
    }
    if (M * N > 500000) {
      EXPECT_LT(rel(gotg, dpre), rel(gotg, dpre_erf)) << label << " GELU gradient closer to erf's than tanh's";
    }
    // Column sums (the bias gradient beside a weight-gradient GEMM): bf16 rows read ld apart
    // (N + 3 at N = 20: off the 4-value lanes, the widening path) and contiguous fp32 rows, added
    // to values already there.
    const int64_t ld = N + (N == 20 ? 3 : 8);
    const auto X = bf16_round(randv(rng, M * ld)), db0 = randv(rng, N);
    std::vector<float> db = db0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) db[size_t(n)] += X[size_t(m * ld + n)];
    Buffer gX = up(X, Storage::BF16), gdb = up(db0);
    cuda::column_sums(gX.get(), M, N, ld, Storage::BF16, gdb.as<float>());
    EXPECT_LE(rel(down(gdb, N), db), 1e-5) << label << " column sums of bf16 rows";
    std::vector<float> Xc = zeros(M * N), dbc = db0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        Xc[size_t(m * N + n)] = X[size_t(m * ld + n)];
        dbc[size_t(n)] += Xc[size_t(m * N + n)];
      }
    Buffer gXc = up(Xc), gdbc = up(db0);
    cuda::column_sums(gXc.get(), M, N, N, Storage::F32, gdbc.as<float>());
    EXPECT_LE(rel(down(gdbc, N), dbc), 1e-5) << label << " column sums of fp32 rows";
  }
  // A GELU epilogue without its aux array, or with beta ≠ 0: a clear error.
  Buffer a = up(zeros(64), Storage::BF16), d(size_t(64) * 2);
  cuda::GemmOut bad{d.get(), Storage::BF16};
  bad.epi = cuda::Epilogue::Gelu;
  EXPECT_THROW(cuda::gemm_out(cuda::Op::N, cuda::Op::N, 8, 8, 8, 1.0f, a.get(), 0, a.get(), 0, 0.0f, bad, 0,
                              Storage::BF16),
               Error);
}

// With tuning on, a new shape's first call times cuBLASLt's candidates on scratch arrays: the
// result is still the one product, added once to what D held (beta 1, in place and from an addend
// apart, which is left as it was), and a GELU epilogue's aux and output are the host's.
TEST(OpsCudaOnly, GemmTuningLeavesTheCallersArraysToTheOneProduct) {
  Rng rng(43);
  const bool was = cuda::gemm_tuning();
  cuda::set_gemm_tuning(true);
  const int64_t M = 190, N = 136, K = 72;  // shapes no other test takes: new plans, tuned
  const auto A = bf16_round(randv(rng, M * K)), B = bf16_round(randv(rng, K * N)), bias = randv(rng, N),
             X = randv(rng, M * N), D0 = randv(rng, M * N);
  std::vector<float> P = zeros(M * N);
  gemm(Trans::No, Trans::No, M, N, K, 1.0f, A.data(), 0, B.data(), 0, 0.0f, P.data(), 0);
  Buffer gA = up(A, Storage::BF16), gB = up(B, Storage::BF16), gbias = up(bias), gX = up(X), gD = up(D0);
  cuda::gemm_out(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 1.0f,
                 cuda::GemmOut{gD.get(), Storage::F32}, 0, Storage::BF16);
  std::vector<float> want = D0;
  for (int64_t i = 0; i < M * N; ++i) want[size_t(i)] += P[size_t(i)];
  EXPECT_LE(rel(down(gD, M * N), want), 1e-5) << "D += A B in place";
  Buffer gD2 = up(zeros(M * N));
  cuda::gemm_out(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 1.0f,
                 cuda::GemmOut{gD2.get(), Storage::F32, gX.get(), gbias.as<float>()}, 0, Storage::BF16);
  for (int64_t i = 0; i < M * N; ++i) want[size_t(i)] = X[size_t(i)] + P[size_t(i)] + bias[size_t(i % N)];
  EXPECT_LE(rel(down(gD2, M * N), want), 1e-5) << "D = X + A B + bias";
  EXPECT_EQ(down(gX, M * N), X) << "the addend is left as it was";
  std::vector<float> pre = P, act = zeros(M * N);
  for (int64_t i = 0; i < M * N; ++i) pre[size_t(i)] += round_to_bf16(bias[size_t(i % N)]);
  gelu_tanh_forward(pre.data(), act.data(), M * N);
  Buffer gG(size_t(M * N) * 2), gaux(size_t(M * N) * 2);
  cuda::GemmOut o{gG.get(), Storage::BF16, nullptr, gbias.as<float>()};
  o.epi = cuda::Epilogue::Gelu, o.aux = gaux.get();
  cuda::gemm_out(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, gA.get(), 0, gB.get(), 0, 0.0f, o, 0, Storage::BF16);
  EXPECT_LE(rel(down(gaux, M * N, Storage::BF16), pre), 4e-3) << "the GELU epilogue's pre-activation";
  EXPECT_LE(rel(down(gG, M * N, Storage::BF16), act), 5e-3) << "the GELU epilogue's output";
  cuda::set_gemm_tuning(was);
}

// Strided batches as MLA's absorption uses them: the heads' slices of interleaved rows (lda, ldc
// wider than the problem), a stride between problems, every transpose; against the host gemm
// on each problem.
TEST(OpsCudaOnly, GemmStridedBatchesMatchOneGemmPerProblem) {
  Rng rng(11);
  const int64_t M = 37, N = 24, K = 19, count = 5;
  for (cuda::Op ta : {cuda::Op::N, cuda::Op::T})
    for (cuda::Op tb : {cuda::Op::N, cuda::Op::T}) {
      // Problem i's A is [M, K] (or [K, M]) at column offset i·sa of rows lda wide; likewise B, C.
      const int64_t ar = ta == cuda::Op::N ? M : K, ac = ta == cuda::Op::N ? K : M;
      const int64_t br = tb == cuda::Op::N ? K : N, bc = tb == cuda::Op::N ? N : K;
      const int64_t lda = count * ac + 3, ldb = bc + 2, sb = br * ldb, ldc = count * N + 1;
      auto A = randv(rng, ar * lda), B = randv(rng, count * sb), C0 = randv(rng, M * ldc);
      std::vector<float> C = C0;
      for (int64_t i = 0; i < count; ++i)
        gemm(ta == cuda::Op::T ? Trans::Yes : Trans::No, tb == cuda::Op::T ? Trans::Yes : Trans::No, M, N, K, 0.5f,
             A.data() + i * ac, lda, B.data() + i * sb, ldb, 2.0f, C.data() + i * N, ldc);
      Buffer gA = up(A, Storage::F32), gB = up(B, Storage::F32), gC = up(C0);
      cuda::gemm_strided(ta, tb, M, N, K, 0.5f, gA.as<float>(), lda, ac, gB.as<float>(), ldb, sb, 2.0f, gC.as<float>(),
                         ldc, N, count);
      EXPECT_LE(rel(down(gC, M * ldc), C), 1e-6) << "ta " << int(ta) << " tb " << int(tb);
    }
}

// apply_each: projections of one input in one grouped GEMM (fp32 and bf16 weights, widths that
// differ) against the host GEMM; with a bias among them, or recording a graph that wants the
// weights' gradients, it takes the linears one by one, and the results are the same.
// The grouped GEMM itself against the host GEMM (fp32 and bf16 operands, rounded on the host:
// exact references), every path of the one-launch kernel:
// - rows 1 to 256 with partial 64-row and 64-column tiles, widths 1 to 130;
// - K of 37 (not a multiple of 8: loads element by element), 40, 384 and 4096 (16-byte vector
//   loads; a last step of K partly past the rows' end, then many steps);
// - an operand one element off its 16-byte alignment (element loads with K % 8 == 0);
// - 70 problems of different sizes (two launches of at most 64, blocks past a problem's tiles);
// - a problem of 300 rows, which sends the whole call to one library GEMM per problem.
// Each case runs twice over outputs filled with -1, so every output must be written each time.
TEST(OpsCudaOnly, GroupedGemmMatchesTheHostGemm) {
  Rng rng(21);
  using Shapes = std::vector<std::pair<int64_t, int64_t>>;
  const Shapes few = {{1, 7}, {9, 130}, {64, 64}, {65, 1}, {256, 40}};
  Shapes many;
  for (int i = 0; i < 70; ++i) many.push_back({1 + (i * 7) % 64, 1 + (i * 13) % 100});
  Shapes library = few;
  library.push_back({300, 33});
  struct Case {
    const Shapes* shapes;
    int64_t K;
    bool offset;  // the first problem's A starts one element past an aligned address
  };
  // K 37 and offset operands take the register path; 36 the ring in fp32 only (whole 16-byte
  // pieces of fp32, not of bf16); the rest the ring, with a partial last stage at K 36 and 40.
  const std::vector<Case> cases = {{&few, 37, false}, {&few, 36, false},  {&few, 40, false},
                                   {&few, 384, false}, {&few, 4096, false}, {&few, 40, true},
                                   {&many, 384, false}, {&library, 40, false}};
  for (const Case& c : cases)
    for (Storage st : {Storage::F32, Storage::BF16}) {
      const Shapes& shapes = *c.shapes;
      const int64_t K = c.K;
      std::vector<std::vector<float>> a, b;
      std::vector<Buffer> da, db, dc;
      std::vector<cuda::GemmProblem> ps;
      const size_t elem = st == Storage::BF16 ? 2 : 4;
      for (const auto& [M, N] : shapes) {
        const int64_t pad = c.offset && ps.empty() ? 1 : 0;
        a.push_back(randv(rng, M * K + pad)), b.push_back(randv(rng, N * K));
        if (st == Storage::BF16) a.back() = bf16_round(a.back()), b.back() = bf16_round(b.back());
        da.push_back(up(a.back(), st)), db.push_back(up(b.back(), st)), dc.emplace_back(size_t(M * N) * 4);
        a.back().erase(a.back().begin(), a.back().begin() + pad);
        ps.push_back({M, static_cast<char*>(da.back().get()) + pad * elem, db.back().get(), dc.back().as<float>(), N});
      }
      for (int run = 0; run < 2; ++run) {
        for (Buffer& x : dc) {
          const std::vector<float> stale(x.bytes() / 4, -1.0f);  // every output must be written
          device::upload(x.get(), stale.data(), x.bytes());
        }
        cuda::gemm_nt_grouped(0, K, ps, st);
        for (size_t i = 0; i < shapes.size(); ++i) {
          const auto [M, N] = shapes[i];
          std::vector<float> want(size_t(M * N));
          gemm(Trans::No, Trans::Yes, M, N, K, 1.0f, a[i].data(), K, b[i].data(), K, 0.0f, want.data(), N);
          EXPECT_LE(rel(down(dc[i], M * N), want), 1e-5)
              << M << " x " << N << " x " << K << (st == Storage::BF16 ? " bf16" : "") << " problem " << i << " of "
              << shapes.size() << (c.offset ? " offset" : "") << " run " << run;
        }
      }
    }
}

TEST(OpsCudaOnly, GroupedProjectionsMatchTheHostGemm) {
  Rng rng(13);
  const int64_t M = 9, D = 40;
  const std::vector<int64_t> outs = {24, 7, 40, 1};
  for (DType wt : {DType::F32, DType::BF16})
    for (int variant = 0; variant < 3; ++variant) {  // grouped, one with a bias, recording
      std::vector<Linear> ls;
      std::vector<std::vector<float>> host_w;
      for (size_t i = 0; i < outs.size(); ++i) {
        ls.emplace_back(D, outs[i], variant == 1 && i == 2 ? Bias::Present : Bias::None);
        auto w = randv(rng, outs[i] * D);
        if (wt == DType::BF16) w = bf16_round(w);
        host_w.push_back(w);
        Tensor t = Tensor::empty({outs[i], D});
        std::copy(w.begin(), w.end(), t.f32());
        ls.back().weight->value = (wt == DType::BF16 ? t.to(DType::BF16) : t).to_device(Device::CUDA);
        if (ls.back().bias) {
          Tensor b = Tensor::empty({outs[i]});
          for (int64_t j = 0; j < outs[i]; ++j) b.f32()[j] = 0.25f * float(j);
          ls.back().bias->value = b.to_device(Device::CUDA);
        }
      }
      auto xh = randv(rng, M * D);
      if (wt == DType::BF16) xh = bf16_round(xh);  // the bf16 GEMM rounds x: keep the reference exact
      Tensor xt = Tensor::empty({M, D});
      std::copy(xh.begin(), xh.end(), xt.f32());
      const Var x = constant(xt.to_device(Device::CUDA));
      std::vector<const Linear*> lp;
      for (const Linear& l : ls) lp.push_back(&l);
      std::optional<Recording> rec;
      if (variant == 2) rec.emplace();
      const std::vector<Var> ys = apply_each(lp, x);
      ASSERT_EQ(ys.size(), outs.size());
      for (size_t i = 0; i < outs.size(); ++i) {
        std::vector<float> want(size_t(M * outs[i]));
        gemm(Trans::No, Trans::Yes, M, outs[i], D, 1.0f, xh.data(), D, host_w[i].data(), D, 0.0f, want.data(), outs[i]);
        if (ls[i].bias)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t j = 0; j < outs[i]; ++j) want[size_t(m * outs[i] + j)] += 0.25f * float(j);
        const Tensor got = ys[i]->value.to_device(Device::CPU);
        ASSERT_EQ(got.numel(), M * outs[i]);
        EXPECT_LE(rel(std::vector<float>(got.f32(), got.f32() + got.numel()), want), 1e-5)
            << "projection " << i << " bf16 " << (wt == DType::BF16) << " variant " << variant;
        if (variant == 2) {
          EXPECT_TRUE(ys[i]->requires_grad) << "recording: the graph is kept";
        }
      }
    }
}

}  // namespace
}  // namespace k3
