// Many rows on AMX tiles with a micro-kernel of our own, for int8 and int4 weights: the
// same numbers as quant_bf16.cpp (each weight d * q + m rounded to bfloat16 as
// dequantize(w).bfloat16() rounds it, each activation rounded to bfloat16, the products
// summed in float32), at about 0.6x its time at 1-32 rows (docs/scale.md). Built where
// the target has AMX-BF16 (quant.h).
//
// The weights are the tiles' A operand, so a weight row widens into a tile row in its own
// order: 32 inputs, one block, are one tile row of 64 bytes. oneDNN's micro-kernel takes
// them as B, in pairs along the input dimension ([in / 2][rows][2]), which needs a 16 x 16
// transpose per block; here the activations take that layout instead, once per call, and
// the weights, widened once per call whatever the rows, skip it. Per task, two A tiles
// (32 weight rows) meet the activations 16 rows (one B tile) or 32 rows (two) at a time;
// the four C tiles hold the sums over the whole input, then go to y transposed (C is
// [weight row][activation row]). Up to 32 activation rows the C tiles hold every sum, so
// the panel is widened a chunk of inputs at a time and multiplied while in L1; more rows
// widen it over the whole input once, into a buffer that stays in L2, for every group.
// oneDNN's per-call dispatch is gone too: at 1-16 rows it cost as much as the products.
#include "bf16_blocks.h"
#include "quant.h"

#if defined(ZMQLLM_QUANT_AMX)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace quant {
namespace {

// Rows of a tile; a tile row is 64 bytes: 32 bfloat16 of A or B, 16 float32 of C.
constexpr int64_t kTile = 16;
// Weight rows per task: two A tiles.
constexpr int64_t kPanelRows = 2 * kTile;
// bfloat16 per tile product along the input dimension (one block of weights).
constexpr int64_t kStep = 32;
// The widened rows are this many bytes longer than the input: with rows of a power of
// two bytes apart, a tile load's 16 rows would fall into the same few cache sets.
constexpr int64_t kRowPad = 64;
// How many weight rows ahead the widening asks for the codes.
constexpr int64_t kPrefetchRows = 2;
// Up to 32 activation rows (two B tiles) the four C tiles hold every sum at once, so a
// panel is widened and multiplied this many inputs at a time: 32 rows x 256 bfloat16 is
// 16 KiB, read by the tiles from L1 right after the widening wrote it (from L2, the
// tiles' loads of a whole-input panel cost more than the products). With two B tiles,
// twice as many (32 KiB): fewer, longer runs of products measured faster there.
constexpr int64_t kChunk = 256;
// More rows: a task widens up to this many bytes of panels (several of 32 weight rows)
// over the whole input, then takes each pair of activation groups (32 rows, 256 KiB at
// 4,096 inputs) through all of them while it stays in L2: the activations are read from
// L3 once per task instead of once per 32 weight rows.
constexpr int64_t kTaskBytes = 1 << 20;

// ldtilecfg's 64-byte operand (palette 1): every tile 16 rows of 64 bytes. Tiles 0-3 are
// C (weight tile i, activation tile j at 2 j + i), 4-5 A, 6-7 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = kTile;
  }
  _tile_loadconfig(&c);
}

// x [rows, in] as bfloat16 in B's layout, 16 rows (zeros past ``rows``) per group:
// [group][in / 2][16][2], one tile of 16 pairs of inputs per kStep.
void pack_activations(const float* x, int64_t rows, int64_t in, uint16_t* out) {
  const int64_t groups = (rows + kTile - 1) / kTile;
  at::parallel_for(0, groups * kTile, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint16_t> row(in);
    for (int64_t r = r0; r < r1; ++r) {
      auto* dst = reinterpret_cast<uint32_t*>(out + (r / kTile) * in * kTile) + r % kTile;
      if (r >= rows) {
        for (int64_t p = 0; p < in / 2; ++p) dst[p * kTile] = 0;
        continue;
      }
      round_rows(x + r * in, in, row.data());
      const auto* pairs = reinterpret_cast<const uint32_t*>(row.data());
      for (int64_t p = 0; p < in / 2; ++p) dst[p * kTile] = pairs[p];
    }
  });
}

// Weight rows n0..n0+kPanelRows (zeros past w.out) as bfloat16 rows of ``stride``
// elements; ``d`` and ``m`` hold room for a row's scales.
void widen_panel(const View& w, int64_t n0, int64_t stride, uint16_t* a, float* d, float* m) {
  for (int64_t i = 0; i < kPanelRows; ++i) {
    const int64_t row = n0 + i;
    uint16_t* dst = a + i * stride;
    if (row >= w.out) {
      std::memset(dst, 0, w.in * sizeof(uint16_t));
      continue;
    }
    if (row + kPrefetchRows < w.out) {
      // The rows ahead: each row's codes are one run, but the next starts a new stream
      // the hardware prefetcher needs a few misses to find.
      const uint8_t* next = w.q + (row + kPrefetchRows) * w.qstride;
      for (int64_t o = 0; o < w.qstride; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
      }
    }
    const RowScales s(w, row, d, m);
    const uint8_t* qrow = w.q + row * w.qstride;
    for (int64_t b = 0; b < w.groups; ++b) {
      const float mb = s.m != nullptr ? s.m[b] : 0.0f;
      _mm512_storeu_si512(dst + b * kGroup, widen_block_bf16(w.kind, qrow, b, s.d[b], mb));
    }
  }
}

// The sums of the panel's 32 weight rows with activation groups g and, if Two, g + 1,
// over the whole input, left in C tiles 0-1 (and 2-3).
template <bool Two>
void tile_products(const uint16_t* a, int64_t stride, const uint16_t* xg, int64_t in) {
  const int64_t astride = stride * sizeof(uint16_t);
  const uint16_t* a1 = a + kTile * stride;
  const uint16_t* xg1 = xg + in * kTile;
  _tile_zero(0);
  _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < in; k += kStep) {
    _tile_loadd(4, a + k, astride);
    _tile_loadd(5, a1 + k, astride);
    _tile_loadd(6, xg + k * kTile, 64);  // kStep / 2 pairs x 16 rows x 2 bfloat16
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (Two) {
      _tile_loadd(7, xg1 + k * kTile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Blocks b0..b1 of the panel's weight rows (zeros past w.out) as bfloat16 rows of
// ``stride`` elements, asking for the next chunk's codes on the way.
void widen_chunk(const View& w, int64_t n0, const RowScales* s, int64_t b0, int64_t b1,
                 int64_t stride, uint16_t* a) {
  const int64_t bytes = w.kind == MatrixKind::kInt4 ? kGroup / 2 : kGroup;
  for (int64_t i = 0; i < kPanelRows; ++i) {
    const int64_t row = n0 + i;
    uint16_t* dst = a + i * stride;
    if (row >= w.out) {
      std::memset(dst, 0, (b1 - b0) * kGroup * sizeof(uint16_t));
      continue;
    }
    const uint8_t* qrow = w.q + row * w.qstride;
    const int64_t ahead = std::min(b1 + (b1 - b0), w.groups);
    for (int64_t o = b1 * bytes; o < ahead * bytes; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(qrow + o), _MM_HINT_T0);
    }
    for (int64_t b = b0; b < b1; ++b) {
      const float mb = s[i].m != nullptr ? s[i].m[b] : 0.0f;
      _mm512_storeu_si512(dst + (b - b0) * kGroup, widen_block_bf16(w.kind, qrow, b, s[i].d[b], mb));
    }
  }
}

// The products of a chunk (inputs k0..k0 + len) added to C tiles 0-1 (and 2-3).
template <bool Two>
void chunk_products(const uint16_t* a, int64_t stride, const uint16_t* xg, int64_t in, int64_t k0,
                    int64_t len) {
  const int64_t astride = stride * sizeof(uint16_t);
  const uint16_t* a1 = a + kTile * stride;
  const uint16_t* x0 = xg + k0 * kTile;
  const uint16_t* x1 = x0 + in * kTile;
  for (int64_t k = 0; k < len; k += kStep) {
    _tile_loadd(4, a + k, astride);
    _tile_loadd(5, a1 + k, astride);
    _tile_loadd(6, x0 + k * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (Two) {
      _tile_loadd(7, x1 + k * kTile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// C tile [16 weight rows][16 activation rows] into y's rows r0.. (up to ``rows``) and
// columns n0.. (up to w.out).
void store_sums(const float* c, int64_t r0, int64_t rows, int64_t n0, int64_t out, float* y) {
  const int64_t live_r = std::min(kTile, rows - r0), live_n = std::min(kTile, out - n0);
  for (int64_t r = 0; r < live_r; ++r) {
    float* yr = y + (r0 + r) * out + n0;
    for (int64_t n = 0; n < live_n; ++n) yr[n] = c[n * kTile + r];
  }
}


// C tiles 0-1 (and 2-3) of activation groups g (and g + 1) into y.
void store_tiles(bool two, float* c, int64_t g, int64_t rows, int64_t n0, int64_t out, float* y) {
  // Tile indices are immediates: one store per tile.
  _tile_stored(0, c, 64);
  store_sums(c, g * kTile, rows, n0, out, y);
  _tile_stored(1, c, 64);
  store_sums(c, g * kTile, rows, n0 + kTile, out, y);
  if (two) {
    _tile_stored(2, c, 64);
    store_sums(c, (g + 1) * kTile, rows, n0, out, y);
    _tile_stored(3, c, 64);
    store_sums(c, (g + 1) * kTile, rows, n0 + kTile, out, y);
  }
}

}  // namespace

void matmul_rows_amx(const View& w, const float* xp, int64_t rows, float* yp) {
  const int64_t groups = (rows + kTile - 1) / kTile;
  thread_local std::vector<uint16_t> xb;
  xb.resize(groups * kTile * w.in);
  pack_activations(xp, rows, w.in, xb.data());
  const uint16_t* xbp = xb.data();
  const bool chunked = groups <= 2;
  const bool two = groups >= 2;
  const int64_t chunk = two ? 2 * kChunk : kChunk;
  const int64_t stride = (chunked ? chunk : w.in) + kRowPad / static_cast<int64_t>(sizeof(uint16_t));
  const int64_t panel_bytes = kPanelRows * stride * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t per_task = chunked ? 1 : std::max<int64_t>(1, kTaskBytes / panel_bytes);
  const int64_t span = per_task * kPanelRows;  // weight rows per task
  const int64_t tasks = (w.out + span - 1) / span;
  at::parallel_for(0, tasks, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> a(span * stride);
    const int64_t scales = w.half ? (chunked ? kPanelRows : 1) * w.groups : 0;
    std::vector<float> d(scales), m(scales);
    std::vector<RowScales> s;
    s.reserve(kPanelRows);
    alignas(64) float c[kTile * kTile];
    configure_tiles();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * span;
      if (chunked) {
        s.clear();
        for (int64_t i = 0; i < kPanelRows; ++i) {
          const int64_t at = w.half ? i * w.groups : 0;
          s.emplace_back(w, std::min(n0 + i, w.out - 1), d.data() + at, m.data() + at);
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < w.in; k0 += chunk) {
          const int64_t len = std::min(chunk, w.in - k0);
          widen_chunk(w, n0, s.data(), k0 / kGroup, (k0 + len) / kGroup, stride, a.data());
          if (two) {
            chunk_products<true>(a.data(), stride, xbp, w.in, k0, len);
          } else {
            chunk_products<false>(a.data(), stride, xbp, w.in, k0, len);
          }
        }
        store_tiles(two, c, 0, rows, n0, w.out, yp);
        continue;
      }
      const int64_t live = std::min(per_task, (w.out - n0 + kPanelRows - 1) / kPanelRows);
      for (int64_t j = 0; j < live; ++j) {
        widen_panel(w, n0 + j * kPanelRows, stride, a.data() + j * kPanelRows * stride, d.data(),
                    m.data());
      }
      for (int64_t g = 0; g < groups; g += 2) {
        const uint16_t* xg = xbp + g * kTile * w.in;
        for (int64_t j = 0; j < live; ++j) {
          const uint16_t* aj = a.data() + j * kPanelRows * stride;
          if (g + 1 < groups) {
            tile_products<true>(aj, stride, xg, w.in);
          } else {
            tile_products<false>(aj, stride, xg, w.in);
          }
          store_tiles(g + 1 < groups, c, g, rows, n0 + j * kPanelRows, w.out, yp);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace quant

#endif
