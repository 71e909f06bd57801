// What the AVX-512 kernels that spread 16 weight rows over a vector's lanes share
// (quant_bf16.cpp, quant_vnni.cpp): a 16 x 16 transpose of 32-bit units, and a block
// range's scales and offsets of 16 weight rows in that layout.
#pragma once

#include "quant.h"

#if defined(ZMQLLM_QUANT_AVX512)
#include <immintrin.h>

#include <algorithm>

namespace quant {

// r[i] holds 16 units of 32 bits (row i's); afterwards r[u] holds unit u of every row:
// three rounds of shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // t[4a + c], in its 128-bit lane L: unit 4L + c of rows 4a..4a+3.
  for (int i = 0; i < 16; i += 4) {
    const __m512i lo0 = t[i], hi0 = t[i + 1], lo1 = t[i + 2], hi1 = t[i + 3];
    t[i] = _mm512_unpacklo_epi64(lo0, lo1);
    t[i + 1] = _mm512_unpackhi_epi64(lo0, lo1);
    t[i + 2] = _mm512_unpacklo_epi64(hi0, hi1);
    t[i + 3] = _mm512_unpackhi_epi64(hi0, hi1);
  }
  // Unit 4L + c gathers lane L of t[c], t[4 + c], t[8 + c], t[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x44);  // lanes 0, 1 of each
    const __m512i b = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xEE);  // lanes 2, 3 of each
    const __m512i e = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x44);
    const __m512i f = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

// Scales and offsets of weight rows n0..n0+16 (past w.out: zeros) for blocks b0..b1 as
// float32 [b1 - b0][16]: d and m (zeros without offsets), 16 blocks at a time.
inline void scales16(const View& w, int64_t n0, int64_t b0, int64_t b1, float* d, float* m) {
  for (int64_t s = b0; s < b1; s += 16) {
    const int64_t n = std::min<int64_t>(16, b1 - s);
    const auto take = static_cast<__mmask16>((1u << n) - 1);
    for (int which = 0; which < 2; ++which) {
      const void* src = which == 0 ? w.d : w.m;
      float* dst = (which == 0 ? d : m) + (s - b0) * 16;
      if (src == nullptr) {
        for (int64_t j = 0; j < n; ++j) _mm512_storeu_ps(dst + j * 16, _mm512_setzero_ps());
        continue;
      }
      __m512i r[16];
      for (int l = 0; l < 16; ++l) {
        const int64_t at = (n0 + l) * w.groups + s;
        if (n0 + l >= w.out) {
          r[l] = _mm512_setzero_si512();
        } else if (w.half) {
          r[l] = _mm512_castps_si512(_mm512_cvtph_ps(
              _mm256_maskz_loadu_epi16(take, static_cast<const uint16_t*>(src) + at)));
        } else {
          r[l] = _mm512_maskz_loadu_epi32(take, static_cast<const float*>(src) + at);
        }
      }
      transpose16(r);
      for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
    }
  }
}

}  // namespace quant

#endif
