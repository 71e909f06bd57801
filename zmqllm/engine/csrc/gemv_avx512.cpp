// gemv's block with AVX-512 (gemv.h): four weight rows against up to four rows of x, each
// weight vector loaded once for all of them, so a few rows of x cost little more than one
// (the weight comes from memory once; the rows of x after the first are L1 work).
#include "gemv.h"

#if defined(ZMQLLM_GEMV_AVX512)
#include <immintrin.h>

#include "simd.h"  // hsum

namespace {

// Lanes 0-7 plus lanes 8-15: the two AVX2 accumulators of dot4 (gemv.cpp) added.
inline __m256 fold(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

// ``ahead``: the next block's weights (the four rows after these), fetched into cache
// while these are multiplied: the hardware's own prefetch alone falls behind the loop,
// the more so the more rows of x (more products per byte read).
template <int R>
void block(const float* w, const float* x, int64_t n, float* y, int64_t ystride) {
  const char* ahead = reinterpret_cast<const char*>(w + 4 * n);
  __m512 acc[4][R];
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < R; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x + i * n + k);
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch(ahead + (r * n + k) * sizeof(float), _MM_HINT_T0);
      const __m512 wv = _mm512_loadu_ps(w + r * n + k);
      for (int i = 0; i < R; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    const float* wr = w + r * n;
    for (int i = 0; i < R; ++i) {
      const float* xi = x + i * n;
      float s = hsum(fold(acc[r][i]));
      for (int64_t j = k; j < n; ++j) s += wr[j] * xi[j];
      y[i * ystride + r] = s;
    }
  }
}

}  // namespace

void dot4_rows_avx512(const float* w, const float* x, int64_t rows, int64_t n, float* y,
                      int64_t ystride) {
  switch (rows) {
    case 1: return block<1>(w, x, n, y, ystride);
    case 2: return block<2>(w, x, n, y, ystride);
    case 3: return block<3>(w, x, n, y, ystride);
    default: return block<4>(w, x, n, y, ystride);
  }
}
#endif
