// Horizontal reductions of AVX2 vectors, shared by the kernels that use AVX2 (gemv.cpp,
// quant_avx2.cpp, quant_avx512.cpp). Empty where the target has no AVX2 and FMA.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The sum of a vector's eight lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The largest of a vector's eight lanes.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif
