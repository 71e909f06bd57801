// Many rows of int4 and int8 weights on AVX512_BF16 (vdpbf16ps) without widening a
// weight to its value: a code is exactly a bfloat16, and a block's scale and offset apply
// to its sums. An int4 code q (0..15) is the bfloat16 128 + q (exponent of 128, q in the
// low mantissa bits: 0x4300 | q):
//   row . x = sum_b [ d_b * sum_j (128 + q_j) x_j + (m_b - 128 d_b) * sum_j x_j ]
// an int8 code (-128..127, eight significant bits) is its own bfloat16:
//   row . x = sum_b [ d_b * sum_j q_j x_j + m_b * sum_j x_j ]
// with x rounded to bfloat16 (nearest even) and every sum in float32. quant_bf16.cpp
// widens each weight to d * q + m in bfloat16 (a lookup or a multiply-add, and a 16 x 16
// transpose per block), about half of its time at 16 rows; here a block's codes become
// their bfloat16 pairs in three (int4) or five (int8) vector operations, and the scales
// cost two multiply-adds per 16 dot products.
//
// Rows are the lanes: a vector holds one input pair of 16 activation rows, and a code
// pair of one weight row is broadcast to it. So a row's sums are the same whatever the
// other rows of the call, or their count, and a weight row's 16 pairs of a block are one
// 64-byte store, no transpose.
//
// Its numbers: the weights exact (as d * q + m up to float32 rounding: no bfloat16
// rounding of the weight), the activations rounded to bfloat16: nearer the float32
// product on the dequantized weight than quant_bf16.cpp's, which also rounds the weights
// (tests/engine/test_quant.py holds each to its reference).
#include "quant.h"

#if defined(ZMQLLM_QUANT_BF16)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "bf16_blocks.h"   // round_rows, int8_block_ps
#include "lanes_avx512.h"  // transpose16

namespace quant {
namespace {

// Weight rows (output columns) per panel: 8 dot-product sums and 8 running totals of 16
// rows each stay in registers with room for the activations.
constexpr int kCols = 8;
constexpr int kLanes = 16;  // activation rows per vector
constexpr int kPairs = kGroup / 2;

// Block ``block`` of an int4 weight row as 16 units of two bfloat16: 128 + q for the
// block's inputs 2p and 2p + 1 in unit p. Byte j of a block holds codes j (low nibble) and
// j + 16 (high nibble), so pair p < 8 is the low nibbles of bytes 2p and 2p + 1, and pair
// p >= 8 the high nibbles of bytes 2p - 16 and 2p - 15.
inline __m512i code_pairs(const uint8_t* block) {
  // Every 128-bit lane holds the block's 16 bytes; unit p takes its two bytes into bits
  // 0..7 and 16..23 (the bytes between zeroed).
  const __m512i bytes =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  const __m512i pick = _mm512_set_epi32(  // unit 15 .. 0
      0x800F800E, 0x800D800C, 0x800B800A, 0x80098008, 0x80078006, 0x80058004, 0x80038002,
      0x80018000, 0x800F800E, 0x800D800C, 0x800B800A, 0x80098008, 0x80078006, 0x80058004,
      0x80038002, 0x80018000);
  const __m512i shr = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m512i units = _mm512_srlv_epi32(_mm512_shuffle_epi8(bytes, pick), shr);
  // Keep the two codes (bits 0..3, 16..19) and set 128's exponent: (A & B) | C.
  return _mm512_ternarylogic_epi32(units, _mm512_set1_epi32(0x000F000F),
                                   _mm512_set1_epi32(0x43004300), 0xEA);
}

// Block ``block`` of an int8 weight row as 16 units of two bfloat16: q for the block's
// inputs 2p and 2p + 1 in unit p (every int8 is exact in bfloat16).
inline __m512i code_pairs_int8(const int8_t* block) {
  __m512 lo, hi;
  int8_block_ps(block, lo, hi);
  // The intrinsic takes its upper half first: so unit p is inputs 2p and 2p + 1.
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// x [rows, in] as the kernel meets it, 16 rows a group (the last padded with zero rows):
// pairs [group][in / 2][16] units of two bfloat16, and each block's sum of the rounded
// values, [group][groups][16] float32.
void lay_rows(const float* x, int64_t rows, int64_t in, uint32_t* pairs, float* sums) {
  const int64_t half = in / 2, groups = in / kGroup;
  thread_local std::vector<uint16_t> rounded;  // a decode step makes ~100 of these calls
  rounded.resize(kLanes * in);
  for (int64_t g = 0; g * kLanes < rows; ++g) {
    const int64_t live = std::min<int64_t>(kLanes, rows - g * kLanes);
    round_rows(x + g * kLanes * in, live * in, rounded.data());
    std::fill(rounded.begin() + live * in, rounded.end(), 0);
    const auto* units = reinterpret_cast<const uint32_t*>(rounded.data());
    uint32_t* gp = pairs + g * half * kLanes;
    for (int64_t p0 = 0; p0 < half; p0 += kLanes) {  // in is a multiple of 32
      __m512i r[kLanes];
      for (int l = 0; l < kLanes; ++l) r[l] = _mm512_loadu_si512(units + l * half + p0);
      transpose16(r);
      for (int u = 0; u < kLanes; ++u) _mm512_storeu_si512(gp + (p0 + u) * kLanes, r[u]);
    }
    float* gs = sums + g * groups * kLanes;
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t b = 0; b < groups; ++b) {
      __m512 s = _mm512_setzero_ps();
      for (int p = 0; p < kPairs; ++p) {
        const __m512i u = _mm512_loadu_si512(gp + (b * kPairs + p) * kLanes);
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(u, high)));
      }
      _mm512_storeu_ps(gs + b * kLanes, s);
    }
  }
}

// Weight rows n0..n0 + 16 (past w.out: zeros), two panels of kCols: their scales d and
// their offsets (zeros without), [block][16] each; for int4 the offsets less 128 d
// (m - 128 d: 128 d is exact, so one rounding, as the two steps give).
void panel_scales(const View& w, int64_t n0, float* d, float* m) {
  scales16(w, n0, 0, w.groups, d, m);
  if (w.kind != MatrixKind::kInt4) return;
  const __m512 k128 = _mm512_set1_ps(128.0f);
  for (int64_t b = 0; b < w.groups; ++b) {
    const __m512 db = _mm512_loadu_ps(d + b * 16);
    _mm512_storeu_ps(m + b * 16, _mm512_fnmadd_ps(k128, db, _mm512_loadu_ps(m + b * 16)));
  }
}

// Block b of weight rows n0..n0 + kCols as codes [kCols][kPairs] units (past w.out the
// last row's codes: their scales are zero).
inline void widen_block(const View& w, int64_t n0, int64_t b, uint32_t* codes) {
  const bool int8 = w.kind == MatrixKind::kInt8;
  const int64_t at = b * (int8 ? kGroup : kPairs);  // the block's first byte in a row
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* q = w.q + std::min(n0 + c, w.out - 1) * w.qstride + at;
    _mm512_storeu_si512(codes + c * kPairs,
                        int8 ? code_pairs_int8(reinterpret_cast<const int8_t*>(q)) : code_pairs(q));
  }
}

// One block of one group of 16 rows: t[c] += the rows' products with weight row c.
inline void block_group(const uint32_t* xb, __m512 xs, const uint32_t* codes, const float* d,
                        const float* m, __m512 t[kCols]) {
  __m512 s[kCols];
  for (int c = 0; c < kCols; ++c) s[c] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + p * kLanes));
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) {
      const auto wv =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(codes[c * kPairs + p])));
      s[c] = _mm512_dpbf16_ps(s[c], xv, wv);
    }
  }
  for (int c = 0; c < kCols; ++c) {
    t[c] = _mm512_fmadd_ps(s[c], _mm512_set1_ps(d[c]), t[c]);
    t[c] = _mm512_fmadd_ps(xs, _mm512_set1_ps(m[c]), t[c]);
  }
}

// The next task's scales and offsets in memory (contiguous runs of ``lines`` 64-byte
// lines each, at most one a block), fetched a line a block while this task computes:
// read when the task starts, they stall it on memory (a fifth of its time at 16 rows).
struct NextScales {
  const char* d = nullptr;
  const char* m = nullptr;
  int64_t lines = 0;

  NextScales() = default;
  NextScales(const View& w, int64_t n0) {
    const int64_t bytes = w.half ? 2 : 4;
    const int64_t rows = std::min<int64_t>(16, w.out - n0);
    d = static_cast<const char*>(w.d) + n0 * w.groups * bytes;
    // Without offsets (GGUF's Q8_0) the scales' lines again: no branch in the fetch loop.
    m = w.m != nullptr ? static_cast<const char*>(w.m) + n0 * w.groups * bytes : d;
    lines = (rows * w.groups * bytes + 63) / 64;
  }
};

// The codes of the next panel's weight rows, fetched into L1 a share a block while this
// panel computes: rows of a few hundred bytes (a small model's output layer: 576 inputs)
// are too short for the hardware's stream prefetcher to catch on (without this its
// product of 16 rows took 10.4 ms on one core, with it 7.5). A 7B layer's long rows
// (a panel of 16-32 KiB) measured the same with it as without.
struct NextCodes {
  const char* q = nullptr;
  int64_t lines = 0;
  int64_t per = 0;  // lines a block

  NextCodes() = default;
  NextCodes(const View& w, int64_t n0)
      : q(reinterpret_cast<const char*>(w.q + n0 * w.qstride)),
        lines((std::min<int64_t>(kCols, w.out - n0) * w.qstride + 63) / 64),
        per((lines + w.groups - 1) / w.groups) {}
};

// Group g of the rows (pairs xg, block sums sg) against weight rows n0..n0 + kCols
// (scales d, offsets m: [block][16]) over every block, into y, fetching the next
// scales and codes (``next``, ``ahead``) meanwhile. Block b + 1 is widened
// before block b is multiplied, so the broadcasts read stores a block old (a fresh
// 64-byte store does not forward to the 4-byte loads of its units). A last group of
// fewer rows runs as a whole one: on Zen 4 256-bit vdpbf16ps issue no faster.
void group_panel(const View& w, const uint32_t* xg, const float* sg, const float* d,
                 const float* m, int64_t n0, int64_t g, int64_t rows, float* y,
                 const NextScales& next, const NextCodes& ahead) {
  alignas(64) uint32_t codes[2][kCols * kPairs];
  __m512 t[kCols];
  for (int c = 0; c < kCols; ++c) t[c] = _mm512_setzero_ps();
  widen_block(w, n0, 0, codes[0]);
  for (int64_t b = 0; b < w.groups; ++b) {
    const int k = b & 1;
    if (b + 1 < w.groups) widen_block(w, n0, b + 1, codes[k ^ 1]);
    if (b < next.lines) {
      _mm_prefetch(next.d + b * 64, _MM_HINT_T0);
      _mm_prefetch(next.m + b * 64, _MM_HINT_T0);
    }
    for (int64_t i = b * ahead.per; i < std::min(ahead.lines, b * ahead.per + ahead.per); ++i) {
      _mm_prefetch(ahead.q + i * 64, _MM_HINT_T0);
    }
    block_group(xg + b * kPairs * kLanes, _mm512_loadu_ps(sg + b * kLanes), codes[k], d + b * 16,
                m + b * 16, t);
  }
  alignas(64) float lanes[kCols][kLanes];
  for (int c = 0; c < kCols; ++c) _mm512_store_ps(lanes[c], t[c]);
  const int64_t live = std::min<int64_t>(kLanes, rows - g * kLanes);
  const int64_t cols = std::min<int64_t>(kCols, w.out - n0);
  for (int64_t l = 0; l < live; ++l) {
    float* yrow = y + (g * kLanes + l) * w.out + n0;
    for (int64_t c = 0; c < cols; ++c) yrow[c] = lanes[c][l];
  }
}

}  // namespace

void matmul_rows_codes(const View& w, const float* xp, int64_t rows, float* yp) {
  const int64_t half = w.in / 2, groups = w.groups;
  const int64_t row_groups = (rows + kLanes - 1) / kLanes;
  // Kept per calling thread, as the other kernels' activation buffers: a decode step
  // makes ~100 of these calls. The tasks below take pointers, not the thread_local names
  // (which there would name the pool threads' own buffers).
  thread_local std::vector<uint32_t> pairs;
  thread_local std::vector<float> sums;
  pairs.resize(row_groups * half * kLanes);
  sums.resize(row_groups * groups * kLanes);
  lay_rows(xp, rows, w.in, pairs.data(), sums.data());
  const uint32_t* xpairs = pairs.data();
  const float* xsums = sums.data();
  // A task is 16 weight rows, two panels that share one reading of their scales.
  at::parallel_for(0, (w.out + 15) / 16, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> d(groups * 16), m(groups * 16);
    for (int64_t p = p0; p < p1; ++p) {
      panel_scales(w, p * 16, d.data(), m.data());
      const NextScales next = p + 1 < p1 ? NextScales(w, (p + 1) * 16) : NextScales();
      const int64_t end = std::min(p * 16 + 16, w.out);
      for (int64_t n0 = p * 16; n0 < end; n0 += kCols) {
        const int64_t c0 = n0 - p * 16;  // the panel's first column among the 16
        // The panel after this one in the task: the next of this task's 16 rows, else the
        // next task's first, else none.
        const int64_t after = n0 + kCols < end ? n0 + kCols : (p + 1 < p1 ? end : -1);
        const NextCodes ahead = after >= 0 ? NextCodes(w, after) : NextCodes();
        // Group by group, each widening the panel's codes again (a few integer operations
        // per 16 dot products): the totals stay in registers.
        for (int64_t g = 0; g < row_groups; ++g) {
          const uint32_t* xg = xpairs + g * half * kLanes;
          const float* sg = xsums + g * groups * kLanes;
          const bool first = c0 == 0 && g == 0;  // fetches the next task's scales
          // The last group fetches the next panel's codes: an earlier one would fetch
          // them a whole group too soon, for the groups between to evict.
          group_panel(w, xg, sg, d.data() + c0, m.data() + c0, n0, g, rows, yp,
                      first ? next : NextScales(), g + 1 < row_groups ? NextCodes() : ahead);
        }
      }
    }
  });
}

}  // namespace quant

#endif
