// Products with int8 and int4 weights (CPU, float32 activations).
//
// A decode step reads every weight once: with 6 or 10 bits per weight (codes,
// scale and minimum) instead of 32 it reads 3 to 5x fewer bytes. Few rows meet
// the weight codes in 16-bit integers (see kXSteps), many rows the dequantized
// weight in float32:
//   row . x = sum_b d_b * (q_b . x_b) + sum_b m_b * sum(x_b)
// The second sum needs each block's sum of x, computed once per call for all rows.
// Few rows (decode) run through this loop, one weight block widened once for all
// of them; many rows (prefill) dequantize a slice of rows at a time into a
// float32 buffer and multiply it with PyTorch's GEMM.
#include "matrix.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>


torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w);  // gemv.cpp

namespace {

// Up to kDirectRows rows take the widening loop in one pass over the weights; up to
// kGemmRows, that loop kDirectRows at a time; more, dequantize + GEMM. Measured at 2
// threads on AVX2 (a Mistral-7B layer's four products, ms per row): the loop costs 6.0-6.6
// from 8 rows to 256, dequantize + GEMM 21 at 32 rows, 12.7 at 64, 7.7 at 128, 5.4 at 256
// (the default model's layer: 0.13-0.15 against 0.35, 0.21, 0.12, 0.09).
constexpr int64_t kDirectRows = 16;
constexpr int64_t kGemmRows = 128;
// Weight rows per task of the widening loop, and per dequantized slice.
constexpr int64_t kGrainRows = 16;
constexpr int64_t kSliceRows = 256;
// Few rows meet the weights in 16-bit integers (AVX2): each block of 32 activations
// in steps of its largest magnitude / kXSteps, so the block products are integer
// multiply-adds (two vpmaddwd per block instead of widening every weight to float).
// The activations' rounding, below 2^-16 of their block's largest, is the only one
// added to the product with the dequantized weight.
constexpr float kXSteps = 32767.0f;
// How far ahead of the block loop the codes are prefetched (bytes).
constexpr int64_t kPrefetch = 1024;

// Raw pointers of a Matrix, taken once per call: data_ptr<T>() checks its type on
// every call, which per weight row cost more than the row's arithmetic.
struct View {
  MatrixKind kind;
  const uint8_t* q;
  const void* d;
  const void* m;  // null without offsets
  bool half;      // d and m are float16
  int64_t in;
  int64_t groups;
  int64_t qstride;  // bytes per weight row

  explicit View(const Matrix& w)
      : kind(w.kind),
        q(static_cast<const uint8_t*>(w.q.data_ptr())),
        d(w.d.data_ptr()),
        m(w.has_min() ? w.m.data_ptr() : nullptr),
        half(w.half_scales()),
        in(w.in),
        groups(w.in / kGroup),
        qstride(w.kind == MatrixKind::kInt8 ? w.in : w.in / 2) {}
};

// n float16 values as float32.
inline void widen_half(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}

// One weight row's scales and offsets as float32: pointers into the Matrix when it holds
// float32, else widened into buffers of the caller's (``groups`` floats each).
struct RowScales {
  const float* d;
  const float* m;  // null without offsets

  RowScales(const View& w, int64_t row, float* dbuf, float* mbuf) {
    const int64_t at = row * w.groups;
    if (!w.half) {
      d = static_cast<const float*>(w.d) + at;
      m = w.m != nullptr ? static_cast<const float*>(w.m) + at : nullptr;
      return;
    }
    widen_half(static_cast<const uint16_t*>(w.d) + at, w.groups, dbuf);
    d = dbuf;
    m = nullptr;
    if (w.m != nullptr) {
      widen_half(static_cast<const uint16_t*>(w.m) + at, w.groups, mbuf);
      m = mbuf;
    }
  }
};

// One block of weights as 32 floats (the portable path and dequantize).
inline void widen_block(const View& w, const RowScales& s, int64_t row, int64_t b, float* out) {
  const float d = s.d[b];
  const float m = s.m != nullptr ? s.m[b] : 0.0f;
  if (w.kind == MatrixKind::kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + row * w.in + b * kGroup;
    for (int64_t j = 0; j < kGroup; ++j) out[j] = d * static_cast<float>(q[j]) + m;
    return;
  }
  const uint8_t* q = w.q + row * w.qstride + b * (kGroup / 2);
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    out[j] = d * static_cast<float>(q[j] & 15) + m;
    out[j + kGroup / 2] = d * static_cast<float>(q[j] >> 4) + m;
  }
}

#if defined(__AVX2__) && defined(__FMA__)

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

// The largest of a vector's eight lanes.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
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

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_AVX512 1

// The 32 codes of blocks b and b + 1 whose activations sit at lanes 0-15 and 16-31
// of a paired vector: v[0] the first 16 weights of each block, v[1] the last 16.
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

// As dot_rows below, two blocks per step: the pair's scales d_b * sx_b spread over
// lanes 0-7 and 8-15.
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
#endif

// The portable row: the same sums from widened blocks.
inline void dot_rows_portable(const View& w, const RowScales& s, int64_t row, const float* x,
                              int64_t rows, float* sums) {
  float block[kGroup];
  for (int64_t r = 0; r < rows; ++r) sums[r] = 0.0f;
  for (int64_t b = 0; b < w.groups; ++b) {
    widen_block(w, s, row, b, block);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * w.in + b * kGroup;
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += block[j] * xb[j];
      sums[r] += s;
    }
  }
}

// Few rows: y [rows, out] through the widening loop.
torch::Tensor matmul_direct(const torch::Tensor& x, const Matrix& matrix) {
  const View w(matrix);
  const int64_t out = matrix.out;
  const int64_t rows = x.size(0);
  const int64_t groups = w.in / kGroup;
  torch::Tensor y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each block's sum of x, [rows, groups], for the offset's share. Buffers kept per
  // calling thread: a decode step makes over a hundred of these calls.
  thread_local std::vector<float> xsum;
  xsum.resize(w.m != nullptr ? rows * groups : 0);
  // Pointers, not the thread_local names: inside the tasks below those would name the
  // pool threads' own (empty) buffers.
  const float* xsp = xsum.data();
#if defined(__AVX2__) && defined(__FMA__)
  // x in 16-bit steps of its block's largest magnitude: sx * xq, |xq| <= 32767.
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> sx;
  xq.resize(rows * w.in);
  sx.resize(rows * groups);
#if defined(ZMQLLM_AVX512)
  const int64_t paired = groups;
#else
  const int64_t paired = 0;
#endif
  quantize_activations(xp, rows * groups, xq.data(), sx.data(),
                       w.m != nullptr ? xsum.data() : nullptr, paired);
  const int16_t* xqp = xq.data();
  const float* sxp = sx.data();
#else
  if (w.m != nullptr) {
    for (int64_t i = 0; i < rows * groups; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
      xsum[i] = s;
    }
  }
#endif
  at::parallel_for(0, out, kGrainRows, [&](int64_t r0, int64_t r1) {
    float sums[kDirectRows];
#if defined(__AVX2__) && defined(__FMA__) && !defined(ZMQLLM_AVX512)
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
#else
    std::vector<float> dbuf(w.half ? groups : 0), mbuf(w.half ? groups : 0);
    for (int64_t row = r0; row < r1; ++row) {
      const RowScales rs(w, row, dbuf.data(), mbuf.data());
#if defined(ZMQLLM_AVX512)
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
#else
      dot_rows_portable(w, rs, row, xp, rows, sums);
#endif
      if (rs.m != nullptr) {
        const float* mrow = rs.m;
        for (int64_t r = 0; r < rows; ++r) {
#if defined(ZMQLLM_AVX512)
          sums[r] += dot_short512(mrow, xsp + r * groups, groups);
#else
          float s = 0.0f;
          for (int64_t b = 0; b < groups; ++b) s += mrow[b] * xsp[r * groups + b];
          sums[r] += s;
#endif
        }
      }
      for (int64_t r = 0; r < rows; ++r) yp[r * out + row] = sums[r];
    }
#endif
  });
  return y;
}

void dequantize_rows(const Matrix& matrix, int64_t r0, int64_t r1, float* out) {
  const View w(matrix);
  at::parallel_for(r0, r1, kGrainRows, [&](int64_t a, int64_t b) {
    std::vector<float> dbuf(w.half ? w.groups : 0), mbuf(w.half ? w.groups : 0);
    for (int64_t row = a; row < b; ++row) {
      const RowScales rs(w, row, dbuf.data(), mbuf.data());
      for (int64_t g = 0; g < w.in / kGroup; ++g) {
        widen_block(w, rs, row, g, out + (row - r0) * w.in + g * kGroup);
      }
    }
  });
}

}  // namespace

Matrix::Matrix(int64_t kind_, torch::Tensor q_, torch::Tensor d_, torch::Tensor m_)
    : kind(static_cast<MatrixKind>(kind_)), q(std::move(q_)), d(std::move(d_)), m(std::move(m_)) {
  TORCH_CHECK(kind_ >= 0 && kind_ <= 2, "Matrix: kind is 0 (float32), 1 (int8) or 2 (int4)");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu(),
              "Matrix: weights must be a contiguous 2-D CPU tensor");
  out = q.size(0);
  if (kind == MatrixKind::kFloat32) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "Matrix: a float32 weight");
    in = q.size(1);
    return;
  }
  in = kind == MatrixKind::kInt8 ? q.size(1) : 2 * q.size(1);
  TORCH_CHECK(q.scalar_type() == (kind == MatrixKind::kInt8 ? torch::kChar : torch::kByte),
              "Matrix: int8 weights as int8, int4 weights as uint8 (two per byte)");
  TORCH_CHECK(in % kGroup == 0, "Matrix: the input dimension must be a multiple of 32");
  const auto groups = std::vector<int64_t>{out, in / kGroup};
  const auto scale = d.scalar_type();
  TORCH_CHECK((scale == torch::kFloat || scale == torch::kHalf) && d.is_contiguous() &&
                  d.sizes() == groups,
              "Matrix: one float32 or float16 scale per block of 32 weights, [out, in / 32]");
  TORCH_CHECK(kind == MatrixKind::kInt8 || m.numel() > 0, "Matrix: int4 needs its minimums");
  if (m.numel() > 0) {
    TORCH_CHECK(m.scalar_type() == scale && m.is_contiguous() && m.sizes() == groups,
                "Matrix: one minimum per block of 32 weights, [out, in / 32], of the scales' dtype");
  }
}

torch::Tensor matmul(const torch::Tensor& x_, const Matrix& w) {
  TORCH_CHECK(x_.scalar_type() == torch::kFloat && x_.dim() == 2 && x_.size(1) == w.in &&
                  x_.device().is_cpu(),
              "matmul: x must be float32 [rows, ", w.in, "] on the CPU");
  const torch::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0);
  if (w.kind == MatrixKind::kFloat32) {
    return rows == 1 ? gemv(x, w.q) : torch::linear(x, w.q);
  }
  if (rows <= kDirectRows) return matmul_direct(x, w);
  if (rows < kGemmRows) {  // kDirectRows at a time, each chunk reading the weights once more
    torch::Tensor y = torch::empty({rows, w.out}, x.options());
    for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
      const int64_t n = std::min(kDirectRows, rows - r0);
      y.narrow(0, r0, n).copy_(matmul_direct(x.narrow(0, r0, n), w));
    }
    return y;
  }
  torch::Tensor y = torch::empty({rows, w.out}, x.options());
  torch::Tensor slice = torch::empty({std::min(kSliceRows, w.out), w.in}, x.options());
  for (int64_t r0 = 0; r0 < w.out; r0 += kSliceRows) {
    const int64_t r1 = std::min(r0 + kSliceRows, w.out);
    dequantize_rows(w, r0, r1, slice.data_ptr<float>());
    y.narrow(1, r0, r1 - r0).copy_(torch::mm(x, slice.narrow(0, 0, r1 - r0).t()));
  }
  return y;
}

torch::Tensor dequantize(const Matrix& w) {
  if (w.kind == MatrixKind::kFloat32) return w.q.clone();
  torch::Tensor out = torch::empty({w.out, w.in}, w.d.options().dtype(torch::kFloat));
  dequantize_rows(w, 0, w.out, out.data_ptr<float>());
  return out;
}
