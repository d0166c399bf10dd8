// The linear layer's product with a block-format weight on the CPU (ops/gemm.h): W [out, in] stays
// packed (core/quant.h) and each weight row is read once. With AVX2 (+ F16C, + FMA) eight codes at
// a time (sixteen with AVX-512) become fp32 through fp16: an E4M3 code's bits placed in an fp16 are its value · 2^-8 (its
// subnormals land on fp16 subnormals, exactly), and an E2M1 code is first mapped to the E4M3 code of
// the same value by a byte shuffle. Elsewhere the scalar decode of core/quant.h.
#include "ops/linear_blocks.h"

#include <algorithm>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define K3_X86_KERNELS 1
#endif

#include "core/fastmath.h"
#include "core/parallel.h"
#include "core/quant.h"

namespace k3 {

namespace {

constexpr int64_t kMaxRows = kBlockRowsFused;

// y[m, r] = beta·y[m, r] + x[m] · W[r] for rows r0 ≤ r < r1, W's row dequantised into buf.
void block_rows_scalar(DType fmt, const void* w, int64_t n, int64_t in, int64_t r0, int64_t r1, const float* x,
                       int64_t M, float* y, int64_t ldy, float beta, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    dequantize_blocks(fmt, w, n, r * in, in, buf);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * in;
      float acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += xm[i] * buf[i];
      float* d = y + m * ldy + r;
      *d = beta == 0.0f ? acc : beta * *d + acc;
    }
  }
}

#if K3_X86_KERNELS
// Eight E4M3 codes (the low 8 bytes of c) as fp32 · 2^-8: each code sign-extended to 16 bits and
// shifted so that its exponent and mantissa sit in an fp16's, with the sign's copy in the fp16's
// top exponent bit cleared. (The NaN code reads as 480 · 2^-8 here; k3 refuses NaN weights at load,
// check_weights_finite, where the scalar decode sees them.)
__attribute__((target("avx2,fma,f16c"))) inline __m256 f8x8(__m128i c) {
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(c), 7), _mm_set1_epi16(short(0xbf80)));
  return _mm256_cvtph_ps(h);
}

// Sixteen bytes of MXFP4 codes (32 values in column order) as 32 E4M3 codes: two 16-byte halves.
__attribute__((target("avx2,fma,f16c"))) inline void fp4_to_f8(__m128i b, __m128i* lo, __m128i* hi) {
  // E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} are E4M3 codes {0, 0x30, 0x38, 0x3c, 0x40, 0x44, 0x48, 0x4c}.
  const __m128i lut = _mm_setr_epi8(0, 0x30, 0x38, 0x3c, 0x40, 0x44, 0x48, 0x4c, char(0x80), char(0xb0), char(0xb8),
                                    char(0xbc), char(0xc0), char(0xc4), char(0xc8), char(0xcc));
  const __m128i nib = _mm_set1_epi8(0x0f);
  const __m128i even = _mm_shuffle_epi8(lut, _mm_and_si128(b, nib));
  const __m128i odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  *lo = _mm_unpacklo_epi8(even, odd);  // values 0..15
  *hi = _mm_unpackhi_epi8(even, odd);  // values 16..31
}

// Eight values of a weight row at column i, as fp32 (already scaled), FMA'd into each row of x.
template <int M>
__attribute__((target("avx2,fma,f16c"))) inline void fma8(__m256* acc, const float* x, int64_t in, __m256 w8, int64_t i) {
  for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * in + i), w8, acc[m]);
}

template <int M>
__attribute__((target("avx2,fma,f16c"))) void block_rows_avx2(bool fp4, const uint8_t* codes, const void* scales,
                                                             int64_t in, int64_t r0, int64_t r1, const float* x,
                                                             float* y, int64_t ldy, float beta) {
  for (int64_t r = r0; r < r1; ++r) {
    __m256 acc[M], blk[M];  // the row's sums, and the current block's (its scale applied once)
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    if (fp4) {
      const uint8_t* c = codes + r * in / 2;
      const uint8_t* s = static_cast<const uint8_t*>(scales) + r * (in / kMxfp4Block);
      for (int64_t b = 0; b < in / kMxfp4Block; ++b) {
        for (int m = 0; m < M; ++m) blk[m] = _mm256_setzero_ps();
        __m128i lo, hi;
        fp4_to_f8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16)), &lo, &hi);
        const int64_t i = b * kMxfp4Block;
        fma8<M>(blk, x, in, f8x8(lo), i);
        fma8<M>(blk, x, in, f8x8(_mm_srli_si128(lo, 8)), i + 8);
        fma8<M>(blk, x, in, f8x8(hi), i + 16);
        fma8<M>(blk, x, in, f8x8(_mm_srli_si128(hi, 8)), i + 24);
        const __m256 sc = _mm256_set1_ps(quant::e8m0_value(s[b]) * 256.0f);
        for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(blk[m], sc, acc[m]);
      }
    } else {
      const uint8_t* c = codes + r * in;
      const float* s = static_cast<const float*>(scales) + r * (in / kF8Block);
      for (int64_t b = 0; b < in / kF8Block; ++b) {
        for (int m = 0; m < M; ++m) blk[m] = _mm256_setzero_ps();
        for (int64_t i = b * kF8Block; i < (b + 1) * kF8Block; i += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i));
          fma8<M>(blk, x, in, f8x8(v), i);
          fma8<M>(blk, x, in, f8x8(_mm_srli_si128(v, 8)), i + 8);
        }
        const __m256 sc = _mm256_set1_ps(s[b] * 256.0f);
        for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(blk[m], sc, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
      const float a = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
      float* d = y + m * ldy + r;
      *d = beta == 0.0f ? a : beta * *d + a;
    }
  }
}

// The same sixteen values at a time with AVX-512 (the decode's arithmetic, not its bytes, bounds
// these products on a few cores, so the wider vectors pay).
// (GCC 12's own avx512fintrin.h leaves a value undefined on purpose in _mm512_cvtph_ps and the
// reductions, which -Wmaybe-uninitialized reports at each use.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define K3_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
K3_AVX512 inline __m512 f8x16(__m128i c) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7), _mm256_set1_epi16(short(0xbf80)));
  return _mm512_cvtph_ps(h);
}
template <int M>
K3_AVX512 inline void fma16(__m512* acc, const float* x, int64_t in, __m512 w16, int64_t i) {
  for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * in + i), w16, acc[m]);
}
template <int M>
K3_AVX512 void block_rows_avx512(bool fp4, const uint8_t* codes, const void* scales, int64_t in, int64_t r0, int64_t r1,
                                 const float* x, float* y, int64_t ldy, float beta) {
  for (int64_t r = r0; r < r1; ++r) {
    __m512 acc[M], blk[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    if (fp4) {
      const uint8_t* c = codes + r * in / 2;
      const uint8_t* s = static_cast<const uint8_t*>(scales) + r * (in / kMxfp4Block);
      for (int64_t b = 0; b < in / kMxfp4Block; ++b) {
        for (int m = 0; m < M; ++m) blk[m] = _mm512_setzero_ps();
        __m128i lo, hi;
        fp4_to_f8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16)), &lo, &hi);
        fma16<M>(blk, x, in, f8x16(lo), b * kMxfp4Block);
        fma16<M>(blk, x, in, f8x16(hi), b * kMxfp4Block + 16);
        const __m512 sc = _mm512_set1_ps(quant::e8m0_value(s[b]) * 256.0f);
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(blk[m], sc, acc[m]);
      }
    } else {
      const uint8_t* c = codes + r * in;
      const float* s = static_cast<const float*>(scales) + r * (in / kF8Block);
      for (int64_t b = 0; b < in / kF8Block; ++b) {
        for (int m = 0; m < M; ++m) blk[m] = _mm512_setzero_ps();
        for (int64_t i = b * kF8Block; i < (b + 1) * kF8Block; i += 16)
          fma16<M>(blk, x, in, f8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i))), i);
        const __m512 sc = _mm512_set1_ps(s[b] * 256.0f);
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(blk[m], sc, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float a = _mm512_reduce_add_ps(acc[m]);
      float* d = y + m * ldy + r;
      *d = beta == 0.0f ? a : beta * *d + a;
    }
  }
}
#undef K3_AVX512
#pragma GCC diagnostic pop

bool has_avx2_f16c() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return simd::level() != simd::Level::Base && __builtin_cpu_supports("f16c");
  }();
  return ok;
}
#endif

void block_rows(DType fmt, const void* w, int64_t n, int64_t in, int64_t r0, int64_t r1, const float* x, int64_t M,
                float* y, int64_t ldy, float beta, float* buf) {
#if K3_X86_KERNELS
  if (has_avx2_f16c()) {
    const bool fp4 = fmt == DType::MXFP4;
    const uint8_t* c = block_codes(w);
    const void* s = block_scales(fmt, w, n);
    if (simd::level() == simd::Level::Avx512) switch (M) {
        case 1: return block_rows_avx512<1>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 2: return block_rows_avx512<2>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 3: return block_rows_avx512<3>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 4: return block_rows_avx512<4>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 5: return block_rows_avx512<5>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 6: return block_rows_avx512<6>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 7: return block_rows_avx512<7>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        case 8: return block_rows_avx512<8>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
        default: break;
      }
    switch (M) {
      case 1: return block_rows_avx2<1>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 2: return block_rows_avx2<2>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 3: return block_rows_avx2<3>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 4: return block_rows_avx2<4>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 5: return block_rows_avx2<5>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 6: return block_rows_avx2<6>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 7: return block_rows_avx2<7>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      case 8: return block_rows_avx2<8>(fp4, c, s, in, r0, r1, x, y, ldy, beta);
      default: break;
    }
  }
#endif
  block_rows_scalar(fmt, w, n, in, r0, r1, x, M, y, ldy, beta, buf);
}

}  // namespace

void linear_blocks(const float* x, int64_t M, int64_t in, int64_t out, const Tensor& w, float* y, float beta) {
  static_assert(kMaxRows == 8, "block_rows has kernels for 1..8 rows");
  const int64_t n = w.numel();
  if (M <= kBlockRowsFused) {
    parallel_for(out, std::max<int64_t>(16, 16384 / std::max<int64_t>(1, in)), [&](int64_t r0, int64_t r1) {
      std::vector<float> row(static_cast<size_t>(in));
      block_rows(w.dtype(), w.raw(), n, in, r0, r1, x, M, y, out, beta, row.data());
    });
    return;
  }
  constexpr int64_t kTile = 256;
  std::vector<float> tile(static_cast<size_t>(std::min(out, kTile) * in));
  for (int64_t t0 = 0; t0 < out; t0 += kTile) {
    const int64_t rows = std::min(kTile, out - t0);
    parallel_for(rows, 8, [&](int64_t r0, int64_t r1) {
      dequantize_blocks(w.dtype(), w.raw(), n, (t0 + r0) * in, (r1 - r0) * in, tile.data() + r0 * in);
    });
    gemm(Trans::No, Trans::Yes, M, rows, in, 1.0f, x, in, tile.data(), in, beta, y + t0, out);
  }
}

}  // namespace k3
