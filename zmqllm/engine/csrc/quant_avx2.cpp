// The quantized widening loop with AVX2 and FMA: each weight block's codes meet the
// activations' 16-bit steps in integer multiply-adds (quant_avx2.h), one float FMA per
// block and row. Built where the target has AVX2 and FMA but not AVX-512 (quant.h).
#include "quant_avx2.h"

#if defined(ZMQLLM_QUANT_AVX2)
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace quant {
namespace {

// How far ahead of the block loop the codes are prefetched (bytes).
constexpr int64_t kPrefetch = 1024;

// y[r, row] for R input rows and one weight row: sum_b sc_rb * (q_b . xq_rb), the
// offset's share left to the caller. xq holds the rows ``in`` apart; sc, each block's
// d_b * sx_rb (block_scales), ``groups`` apart. The block products are exact in int32:
// |q| <= 255, |xq| <= 32767.
template <int R>
inline void dot_rows(const View& w, int64_t row, const float* sc, const int16_t* xq,
                     float* sums) {
  const int64_t groups = w.groups;
  const uint8_t* qrow = w.q + row * w.qstride;
  // Two accumulators per row, even and odd blocks, so that a block does not wait for the
  // previous block's FMA. The loop steps two blocks so that each has a name: indexed by
  // b & 1 at run time they lived on the stack, and every block waited for a store.
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  int64_t b = 0;
  // Codes kPrefetch bytes ahead asked for now (past the row's end: the next row's): the
  // hardware prefetcher alone left the loads of the codes waiting on memory.
  const int64_t block_bytes = w.kind == MatrixKind::kInt8 ? kGroup : kGroup / 2;
  for (; b + 2 <= groups; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(qrow + b * block_bytes + kPrefetch), _MM_HINT_T0);
    __m256i v0[2], v1[2];
    widen_q16(w, qrow, b, v0);
    widen_q16(w, qrow, b + 1, v1);
    for (int r = 0; r < R; ++r) {
      const int16_t* xb = xq + r * w.in + b * kGroup;
      const float* s = sc + r * groups + b;
      even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_products(v0, xb)),
                                _mm256_broadcast_ss(s), even[r]);
      odd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_products(v1, xb + kGroup)),
                               _mm256_broadcast_ss(s + 1), odd[r]);
    }
  }
  if (b < groups) {  // an odd count's last block
    __m256i v[2];
    widen_q16(w, qrow, b, v);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_products(v, xq + r * w.in + b * kGroup)),
                                _mm256_broadcast_ss(sc + r * groups + b), even[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_add_ps(even[r], odd[r]));
}

// Eight of a row's scales or offsets from i on, float16 or float32, as float32.
inline __m256 load8(const void* p, bool half, int64_t i) {
  if (half) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

inline float load1(const void* p, bool half, int64_t i) {
  if (half) return static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()));
  return static_cast<const float*>(p)[i];
}

// sc[r, b] = d[row, b] * sx[r, b] for ``rows`` input rows: one weight row's scales times
// each input block's step, once per weight row rather than per block, read from the
// Matrix as they are (float16 widened in registers, not through a buffer).
inline void block_scales(const View& w, int64_t row, const float* sx, int64_t rows, float* sc) {
  const int64_t groups = w.groups, at = row * groups;
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sx + r * groups;
    float* o = sc + r * groups;
    int64_t b = 0;
    for (; b + 8 <= groups; b += 8) {
      _mm256_storeu_ps(o + b, _mm256_mul_ps(load8(w.d, w.half, at + b), _mm256_loadu_ps(s + b)));
    }
    for (; b < groups; ++b) o[b] = load1(w.d, w.half, at + b) * s[b];
  }
}

// sum_b m[row, b] * xsum[b]: a weight row's offsets against one input row's block sums.
inline float offsets(const View& w, int64_t row, const float* xsum) {
  const int64_t groups = w.groups, at = row * groups;
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= groups; b += 8) {
    acc = _mm256_fmadd_ps(load8(w.m, w.half, at + b), _mm256_loadu_ps(xsum + b), acc);
  }
  float sum = hsum(acc);
  for (; b < groups; ++b) sum += load1(w.m, w.half, at + b) * xsum[b];
  return sum;
}

}  // namespace

void matmul_rows_avx2(const View& w, const float* xp, int64_t rows, float* yp) {
  const int64_t out = w.out;
  const int64_t groups = w.groups;
  // x in 16-bit steps of its block's largest magnitude (sx * xq, |xq| <= 32767), each
  // block's sum [rows, groups] for the offset's share.
  const QuantizedRows x = quantize_rows(w, xp, rows, 0);
  const float* xsp = x.xsum;
  const int16_t* xqp = x.xq;
  const float* sxp = x.sx;
  at::parallel_for(0, out, kGrainRows, [&](int64_t r0, int64_t r1) {
    float sums[kDirectRows];
    std::vector<float> sc(rows * groups);
    for (int64_t row = r0; row < r1; ++row) {
      block_scales(w, row, sxp, rows, sc.data());
      for (int64_t r = 0; r < rows; r += 4) {
        const int16_t* xr = xqp + r * w.in;
        const float* s = sc.data() + r * groups;
        switch (std::min<int64_t>(4, rows - r)) {
          case 1: dot_rows<1>(w, row, s, xr, sums + r); break;
          case 2: dot_rows<2>(w, row, s, xr, sums + r); break;
          case 3: dot_rows<3>(w, row, s, xr, sums + r); break;
          default: dot_rows<4>(w, row, s, xr, sums + r); break;
        }
      }
      if (w.m != nullptr) {
        for (int64_t r = 0; r < rows; ++r) sums[r] += offsets(w, row, xsp + r * groups);
      }
      for (int64_t r = 0; r < rows; ++r) yp[r * out + row] = sums[r];
    }
  });
}

}  // namespace quant

#endif
