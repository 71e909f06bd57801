// Several rows with 8-bit activations on AVX-512 VNNI (vpdpbusd: 64 byte products a
// vector): int4 and int8 weights meet activations quantized to int8 per block of 32,
// as llama.cpp's Q4_1 x Q8_1 does, with the weights spread over the vector's lanes so
// that a block's scales are applied once per 16 weight rows, not once per weight row.
// Built where the target has AVX-512 VNNI (quant.h); taken only where a worker asks for
// it ([worker] int8_activations): its numbers miss the exactness rule (docs/scale.md).
//
// Per task, a panel of 16 weight rows is repacked from its blocks into the layout
// vpdpbusd reads (unsigned bytes, [block][unit of 4 inputs][16 rows][4]) and kept in L2
// while every activation row meets it: lane l of a vector sums row l's four codes times
// four activations broadcast from memory. Repacking an int4 byte is an and or a shift
// (no conversion to float), done once per call whatever the rows.
//
// Its numbers: x in steps sx_b = max|x_b| / 127 of each block, rounded to nearest even;
// each block's codes . steps summed exactly in int32 (int4 codes as q - 8); then
//   y = sum_b (d_b * sx_b) * isum_b + m'_b * sum(x_b),  m' = m + 8 d for int4 (one
// rounding), m for int8,
// in float32 (tests/engine/test_quant.py holds it to that, and to HF within a tolerance).
#include "lanes_avx512.h"
#include "quant.h"

#if defined(ZMQLLM_QUANT_VNNI)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace quant {
namespace {

constexpr int64_t kLanes = 16;                // weight rows per panel
constexpr int64_t kUnits = kGroup / 4;        // vpdpbusd units of 4 inputs per block
constexpr int64_t kBlockBytes = kUnits * 64;  // one block of a panel
// Activation rows per pass over a panel: 8 weight vectors, R int32 and R float32
// accumulators and the block's scales stay in the 32 vector registers.
constexpr int kRowsPerPass = 6;
// How far ahead of the repacking the weight rows are prefetched, in blocks.
constexpr int64_t kPrefetchBlocks = 16;

// x quantized per block: codes [rows, in] int8, steps [rows, groups], each block's sum
// of x (for the offsets m) and -128 (int8 weights) or -8 (int4) times its sum of codes
// (quantize_int8 says why).
struct Int8Rows {
  std::vector<int8_t> xq;
  std::vector<float> sx;
  std::vector<float> xsum;
  std::vector<int32_t> start;  // each block's int32 sums start here
};

void quantize_block(const float* x, int8_t* q, float* step, float* sum, int32_t* qsum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  *step = amax / 127.0f;
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  // Round to nearest even (the default rounding); |x * inv| <= 127 (up to one ulp).
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

void quantize_int8(const View& w, const float* x, int64_t rows, Int8Rows& out) {
  const int64_t groups = w.groups;
  out.xq.resize(rows * w.in);
  out.sx.resize(rows * groups);
  out.xsum.resize(rows * groups);
  out.start.resize(rows * groups);
  // vpdpbusd wants the weights unsigned: int8 codes are stored in the panel as q + 128,
  // and sum (q + 128) * xq = sum q * xq + 128 * sum xq, so the sum starts at -128 * sum xq.
  // Int4 codes 0..15 are taken as q - 8, their offset as m + 8 d (repack_panel): codes
  // centred on the block's middle carry a third of the error of 8-bit steps that
  // codes 0..15 would (the error grows with |codes| and sums of |d q| over a block run
  // about twice |w|'s).
  const int32_t shift = w.kind == MatrixKind::kInt8 ? 128 : 8;
  int8_t* xq = out.xq.data();
  float* sx = out.sx.data();
  float* xs = out.xsum.data();
  int32_t* st = out.start.data();
  at::parallel_for(0, rows * groups, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int32_t qsum;
      quantize_block(x + i * kGroup, xq + i * kGroup, sx + i, xs + i, &qsum);
      st[i] = -shift * qsum;
    }
  });
}

// Two blocks (b, b + 1) of one weight row (its codes at ``qrow``) as 64 unsigned codes
// in input order; only block b when ``one``.
inline __m512i row_codes(MatrixKind kind, const uint8_t* qrow, int64_t b, bool one) {
  if (kind == MatrixKind::kInt8) {
    const uint8_t* q = qrow + b * kGroup;
    const __m512i v = one ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)))
                          : _mm512_loadu_si512(q);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // 16 bytes a block: byte j holds weight j (low nibble) and j + 16 (high nibble).
  const uint8_t* q = qrow + b * (kGroup / 2);
  const __m256i raw = one ? _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  // 128-bit lanes: block b, b, b + 1, b + 1; low nibbles in the first of each pair.
  const __m512i z = _mm512_shuffle_i64x2(_mm512_castsi256_si512(raw), _mm512_castsi256_si512(raw),
                                         _MM_SHUFFLE(1, 1, 0, 0));
  const __m512i both = _mm512_mask_blend_epi64(0xCC, z, _mm512_srli_epi16(z, 4));
  return _mm512_and_si512(both, _mm512_set1_epi8(15));
}

// Weight rows n0..n0+16 (past w.out: zeros) as a panel: codes [groups][kUnits][16][4]
// bytes, scales and offsets [groups][16] float32.
void repack_panel(const View& w, int64_t n0, uint8_t* codes, float* d, float* m) {
  const int64_t groups = w.groups;
  const int64_t live = std::min<int64_t>(16, w.out - n0);
  const uint8_t* q0 = w.q + n0 * w.qstride;
  for (int64_t b = 0; b < groups; b += 2) {
    const bool one = b + 1 == groups;
    __m512i r[16];
    for (int l = 0; l < 16; ++l) {
      r[l] = l < live ? row_codes(w.kind, q0 + l * w.qstride, b, one) : _mm512_setzero_si512();
    }
    // Sixteen rows read side by side are sixteen streams, more than the hardware
    // prefetcher follows (without this the repacking took a fifth longer).
    if (b + kPrefetchBlocks < groups) {
      const int64_t ahead = w.kind == MatrixKind::kInt8 ? (b + kPrefetchBlocks) * kGroup
                                                       : (b + kPrefetchBlocks) * (kGroup / 2);
      for (int l = 0; l < live; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(q0 + l * w.qstride + ahead), _MM_HINT_T0);
      }
    }
    transpose16(r);
    // Units 0..7 are block b's, 8..15 block b + 1's: consecutive in the panel.
    uint8_t* dst = codes + b * kBlockBytes;
    for (int u = 0; u < (one ? kUnits : 2 * kUnits); ++u) _mm512_storeu_si512(dst + u * 64, r[u]);
  }
  scales16(w, n0, 0, groups, d, m);
  if (w.kind == MatrixKind::kInt4) {  // the offset of codes q - 8: m + 8 d
    for (int64_t b = 0; b < groups; ++b) {
      const __m512 db = _mm512_loadu_ps(d + b * 16);
      _mm512_storeu_ps(m + b * 16, _mm512_fmadd_ps(db, _mm512_set1_ps(8.0f), _mm512_loadu_ps(m + b * 16)));
    }
  }
}

// y[r, n0..n0+16] for R activation rows r0.. and one panel.
template <int R>
inline void panel_rows(const View& w, const uint8_t* codes, const float* d, const float* m,
                       const Int8Rows& x, int64_t r0, float* y, int64_t ldy, __mmask16 keep) {
  const int64_t groups = w.groups;
  const int64_t in = w.in;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xq = x.xq.data() + r0 * in;
  const float* sx = x.sx.data() + r0 * groups;
  const float* xs = x.xsum.data() + r0 * groups;
  const int32_t* st = x.start.data() + r0 * groups;
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* cb = codes + b * kBlockBytes;
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_set1_epi32(st[r * groups + b]);
    for (int u = 0; u < kUnits; ++u) {
      const __m512i wv = _mm512_loadu_si512(cb + u * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * in + b * kGroup + 4 * u, 4);
        sums[r] = _mm512_dpbusd_epi32(sums[r], wv, _mm512_set1_epi32(four));
      }
    }
    const __m512 db = _mm512_loadu_ps(d + b * 16), mb = _mm512_loadu_ps(m + b * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(db, _mm512_set1_ps(sx[r * groups + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xs[r * groups + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

}  // namespace

void matmul_rows_vnni(const View& w, const float* xp, int64_t rows, float* yp) {
  thread_local Int8Rows x;
  quantize_int8(w, xp, rows, x);
  const Int8Rows& xr = x;  // the tasks below read the caller's, not their own thread's
  const int64_t panels = (w.out + kLanes - 1) / kLanes;
  const int64_t groups = w.groups;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> codes(groups * kBlockBytes);
    std::vector<float> d(groups * 16), m(groups * 16);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kLanes;
      repack_panel(w, n0, codes.data(), d.data(), m.data());
      const int64_t width = std::min(kLanes, w.out - n0);
      const auto keep = static_cast<__mmask16>((1u << width) - 1);
      float* y = yp + n0;
      int64_t r = 0;
      for (; r + kRowsPerPass <= rows; r += kRowsPerPass) {
        panel_rows<kRowsPerPass>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep);
      }
      switch (rows - r) {
        case 0: break;
        case 1: panel_rows<1>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep); break;
        case 2: panel_rows<2>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep); break;
        case 3: panel_rows<3>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep); break;
        case 4: panel_rows<4>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep); break;
        default: panel_rows<5>(w, codes.data(), d.data(), m.data(), xr, r, y + r * w.out, w.out, keep); break;
      }
    }
  });
}

}  // namespace quant

#endif
