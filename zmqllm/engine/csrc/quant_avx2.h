// The AVX2 building blocks of the quantized kernels: widening the codes to 16 bits,
// their exact integer products, and the activations in 16-bit steps. Used by the AVX2
// kernel (quant_avx2.cpp) and the AVX-512 one (quant_avx512.cpp), which still meets an
// odd block and quantizes the activations 256 bits at a time.
#pragma once

#include "quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <vector>

#include "simd.h"  // hsum, hmax

namespace quant {

// Few rows meet the weights in 16-bit integers: each block of 32 activations in steps
// of its largest magnitude / kXSteps, so the block products are integer multiply-adds
// (two vpmaddwd per block instead of widening every weight to float). The activations'
// rounding, below 2^-16 of their block's largest, is the only one added to the product
// with the dequantized weight.
constexpr float kXSteps = 32767.0f;

// The 32 weights of block b as two vectors of 16 int16 (codes, without scale or offset).
inline void widen_q16(const View& w, const uint8_t* qrow, int64_t b, __m256i v[2]) {
  if (w.kind == MatrixKind::kInt8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + b * kGroup));
    v[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
    v[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
    return;
  }
  // Each byte widened to 16 bits once; its low nibble is weight j, its high one j + 16.
  const __m256i raw = _mm256_cvtepu8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + b * kGroup / 2)));
  v[0] = _mm256_and_si256(raw, _mm256_set1_epi16(15));
  v[1] = _mm256_srli_epi16(raw, 4);
}

// One block's codes (from widen_q16) against its 32 activations xb: eight int32 lanes
// of pair sums, exact.
inline __m256i block_products(const __m256i v[2], const int16_t* xb) {
  return _mm256_add_epi32(
      _mm256_madd_epi16(v[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
      _mm256_madd_epi16(v[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
}

// With AVX-512 two blocks meet in one 512-bit product. Their activations are laid out
// in pairs so that the codes of blocks b and b + 1 line up with plain loads: per pair,
// [x_b 0..15, x_b+1 0..15, x_b 16..31, x_b+1 16..31] (the low nibbles' weights, then
// the high ones'). A row's last block, when its count is odd, keeps the plain order.
inline int64_t paired_offset(int64_t b, int64_t groups, int half) {
  if (b == groups - 1 && (groups & 1)) return b * kGroup + half * 16;
  return (b >> 1) * 2 * kGroup + half * kGroup + (b & 1) * 16;
}

// n blocks of x in 16-bit steps of each block's largest magnitude (x ~ sx * xq), and
// each block's sum (xsum, when not null) for the offsets' share. Rounds to nearest
// even, as lrint does in the default rounding mode.
inline void quantize_activations(const float* x, int64_t n, int16_t* xq, float* sx,
                                 float* xsum, int64_t paired_groups = 0) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* xb = x + i * kGroup;
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const float amax = hmax(_mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
        _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3))));
    if (xsum != nullptr) {
      xsum[i] = hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    }
    const float step = amax > 0.0f ? amax / kXSteps : 1.0f;
    const __m256 inv = _mm256_set1_ps(1.0f / step);
    // packs_epi32 interleaves 128-bit lanes; the permute puts the 16 values back in order.
    const __m256i lo = _mm256_permute4x64_epi64(
        _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv))), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(
        _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv))), 0xD8);
    // Plain: block i's 32 values in order. Paired (paired_groups blocks per row): see
    // paired_offset.
    int16_t* first = xq + i * kGroup;
    int16_t* last = first + 16;
    if (paired_groups > 0) {
      const int64_t row = i / paired_groups, b = i % paired_groups;
      int16_t* base = xq + row * paired_groups * kGroup;
      first = base + paired_offset(b, paired_groups, 0);
      last = base + paired_offset(b, paired_groups, 1);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(first), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(last), hi);
    sx[i] = step;
  }
}

// A call's rows of x as both kernels read them: in 16-bit steps (xq, laid out for
// paired_groups as in quantize_activations), each block's step (sx) and sum (xsum, for
// the offsets' share). Buffers kept per calling thread: a decode step makes over a
// hundred of these calls. The tasks of a parallel_for get these pointers, since the
// thread_local names would name each pool thread's own (empty) buffers there.
struct QuantizedRows {
  const float* xsum;
  const int16_t* xq;
  const float* sx;
};

inline QuantizedRows quantize_rows(const View& w, const float* x, int64_t rows,
                                   int64_t paired_groups) {
  thread_local std::vector<float> xsum;
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> sx;
  xsum.resize(w.m != nullptr ? rows * w.groups : 0);
  xq.resize(rows * w.in);
  sx.resize(rows * w.groups);
  quantize_activations(x, rows * w.groups, xq.data(), sx.data(),
                       w.m != nullptr ? xsum.data() : nullptr, paired_groups);
  return {xsum.data(), xq.data(), sx.data()};
}

}  // namespace quant

#endif
