// What the bfloat16 products (quant_bf16.cpp on oneDNN's micro-kernel, quant_amx.cpp on
// AMX tiles of its own) share: a weight block widened to bfloat16 exactly as
// dequantize(w).bfloat16() rounds it, and activations rounded to bfloat16.
#pragma once

#include "quant.h"

#if defined(ZMQLLM_QUANT_BF16)
#include <immintrin.h>

namespace quant {

// An int8 block's 32 codes as float32: inputs 0..15 in lo, 16..31 in hi (exact).
inline void int8_block_ps(const int8_t* q, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
}

// Block b of a weight row as 32 bfloat16 in order (weights 0..31), rounded to nearest
// even from d * q + m in float32, multiplied then added (no fused multiply-add) as
// dequantize() computes it, so the two round to the same bfloat16.
inline __m512i widen_block_bf16(MatrixKind kind, const uint8_t* qrow, int64_t b, float d, float m) {
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  if (kind == MatrixKind::kInt4) {
    // A block's 16 possible weights, then each code looks its own up: half the float
    // work of widening each weight, and no int-to-float conversion (the widening is
    // most of the many-row products' time).
    __m512 t = _mm512_mul_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), vd);
    __asm__("" : "+v"(t));  // multiplied, then added: as dequantize() rounds
    const __m512i table =
        _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(t, vm))));
    // Byte j holds weight j (low nibble) and j + 16 (high nibble).
    const __m256i raw = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + b * kGroup / 2)));
    const __m512i codes = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(raw, _mm256_set1_epi16(15))),
        _mm256_srli_epi16(raw, 4), 1);
    return _mm512_permutexvar_epi16(codes, table);
  }
  __m512 lo, hi;
  int8_block_ps(reinterpret_cast<const int8_t*>(qrow) + b * kGroup, lo, hi);
  __m512 dlo = _mm512_mul_ps(lo, vd), dhi = _mm512_mul_ps(hi, vd);
  // The compiler would fuse the multiply into the add below (one rounding, not two).
  __asm__("" : "+v"(dlo), "+v"(dhi));
  return reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(_mm512_add_ps(dhi, vm), _mm512_add_ps(dlo, vm)));
}

// x [rows, in] float32 as bfloat16, rounded to nearest even.
inline void round_rows(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(v));
  }
  for (; i < n; ++i) {
    const __m128bh v = _mm_cvtneps_pbh(_mm_set_ss(x[i]));
    out[i] = static_cast<uint16_t>(_mm_extract_epi16(reinterpret_cast<__m128i>(v), 0));
  }
}

}  // namespace quant

#endif
