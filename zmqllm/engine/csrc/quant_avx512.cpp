// The quantized widening loop with AVX-512 (F and BW; VNNI where the target has it): two
// weight blocks meet their activations in one 512-bit integer product and one FMA scales
// both. Built where the target has AVX-512 (quant.h); it uses the AVX2 building blocks
// (quant_avx2.h) for the activations and for a row's odd last block.
#include "quant_avx2.h"

#if defined(ZMQLLM_QUANT_AVX512)
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace quant {
namespace {

// The 32 codes of blocks b and b + 1 whose activations sit at lanes 0-15 and 16-31
// of a paired vector (paired_offset): v[0] the first 16 weights of each block, v[1]
// the last 16.
inline void widen_pair(const View& w, const uint8_t* qrow, int64_t b, __m512i v[2]) {
  if (w.kind == MatrixKind::kInt8) {
    const uint8_t* q0 = qrow + b * kGroup;
    const __m256i first = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(q0 + kGroup),
                                              reinterpret_cast<const __m128i*>(q0));
    const __m256i last = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(q0 + kGroup + 16),
                                             reinterpret_cast<const __m128i*>(q0 + 16));
    v[0] = _mm512_cvtepi8_epi16(first);
    v[1] = _mm512_cvtepi8_epi16(last);
    return;
  }
  // 16 bytes per block, adjacent: byte j of each block holds weights j and j + 16.
  const __m512i raw = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + b * kGroup / 2)));
  v[0] = _mm512_and_si512(raw, _mm512_set1_epi16(15));
  v[1] = _mm512_srli_epi16(raw, 4);
}

// Lanes 0-7 and 8-15 of a pair's int32 products: codes . activations, exact.
inline __m512i pair_products(const __m512i v[2], const int16_t* xp) {
  const __m512i x0 = _mm512_loadu_si512(xp);
  const __m512i x1 = _mm512_loadu_si512(xp + kGroup);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(v[0], x0), v[1], x1);
#else
  return _mm512_add_epi32(_mm512_madd_epi16(v[0], x0), _mm512_madd_epi16(v[1], x1));
#endif
}

// y[r, row] for R input rows and one weight row, without the offsets' share: the
// pair's scales d_b * sx_b spread over lanes 0-7 and 8-15. xq holds the rows ``in``
// apart in the paired layout; sx, each block's step, ``groups`` apart.
template <int R>
inline void dot_rows512(const View& w, int64_t row, const float* drow, const int16_t* xq,
                        const float* sx, float* sums) {
  const int64_t groups = w.groups;
  const uint8_t* qrow = w.q + row * w.qstride;
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t pairs = groups >> 1;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = 2 * p;
    __m512i v[2];
    widen_pair(w, qrow, b, v);
    const __m128 d = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(drow + b)));
    for (int r = 0; r < R; ++r) {
      const __m512i prod = pair_products(v, xq + r * w.in + b * kGroup);
      const __m128 s = _mm_mul_ps(
          d, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sx + r * groups + b))));
      const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
  if (groups & 1) {  // the last block alone, in the plain layout
    const int64_t b = groups - 1;
    __m256i v[2];
    widen_q16(w, qrow, b, v);
    for (int r = 0; r < R; ++r) {
      const __m256i p = block_products(v, xq + r * w.in + b * kGroup);
      sums[r] += hsum(_mm256_cvtepi32_ps(p)) * (drow[b] * sx[r * groups + b]);
    }
  }
}

// sum_b a[b] * b[b] over n values, sixteen lanes at a time, the tail masked.
inline float dot_short512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i),
                          acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

void matmul_rows_avx512(const View& w, const float* xp, int64_t rows, float* yp) {
  const int64_t out = w.out;
  const int64_t groups = w.groups;
  // x in 16-bit steps of its block's largest magnitude, in block pairs (paired_offset),
  // each block's sum [rows, groups] for the offset's share.
  const QuantizedRows x = quantize_rows(w, xp, rows, groups);
  const float* xsp = x.xsum;
  const int16_t* xqp = x.xq;
  const float* sxp = x.sx;
  at::parallel_for(0, out, kGrainRows, [&](int64_t r0, int64_t r1) {
    float sums[kDirectRows];
    std::vector<float> dbuf(w.half ? groups : 0), mbuf(w.half ? groups : 0);
    for (int64_t row = r0; row < r1; ++row) {
      const RowScales rs(w, row, dbuf.data(), mbuf.data());
      for (int64_t r = 0; r < rows; r += 4) {
        const int16_t* xr = xqp + r * w.in;
        const float* sr = sxp + r * groups;
        switch (std::min<int64_t>(4, rows - r)) {
          case 1: dot_rows512<1>(w, row, rs.d, xr, sr, sums + r); break;
          case 2: dot_rows512<2>(w, row, rs.d, xr, sr, sums + r); break;
          case 3: dot_rows512<3>(w, row, rs.d, xr, sr, sums + r); break;
          default: dot_rows512<4>(w, row, rs.d, xr, sr, sums + r); break;
        }
      }
      if (rs.m != nullptr) {
        const float* mrow = rs.m;
        for (int64_t r = 0; r < rows; ++r) sums[r] += dot_short512(mrow, xsp + r * groups, groups);
      }
      for (int64_t r = 0; r < rows; ++r) yp[r * out + row] = sums[r];
    }
  });
}

}  // namespace quant

#endif
