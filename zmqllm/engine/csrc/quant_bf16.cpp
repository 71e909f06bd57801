// Many rows on the 16-bit matrix units: int8 and int4 weights widened to bfloat16 a
// panel at a time, multiplied by oneDNN's batch-reduce GEMM micro-kernel (brgemm, as
// PyTorch exports it), which runs on AMX tiles where the CPU has them and on AVX512_BF16
// (vdpbf16ps) otherwise. Built where the target has AVX512_BF16 (quant.h).
//
// Per task, a panel of kPanel weight rows (output columns) and kChunk inputs is widened
// from its blocks into a cache-resident buffer in the layout the micro-kernel reads
// (pairs along the input dimension: [kChunk / 2][kPanel][2]), then every activation row
// meets it in one call, the sums kept in float32 across chunks. The weights are read
// once per call whatever the rows, as by the widening loop; each is widened once per
// call, not once per row.
//
// Its numbers: each weight w = d * q + m rounded to bfloat16 (as dequantize(w).bfloat16()
// rounds it) and each activation rounded to bfloat16, the products summed in float32: the
// product of HF's bfloat16 weights with float32 accumulation (tests/engine/test_quant_bf16.py).
#include "bf16_blocks.h"
#include "lanes_avx512.h"
#include "quant.h"

#if defined(ZMQLLM_QUANT_BF16)
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace quant {
namespace {

// Weight rows per panel (four 16-wide vectors of the micro-kernel's output) and inputs
// per chunk: a panel of 64 x 1024 bfloat16 is 128 KiB, resident in L2 while every row of
// the call passes over it.
constexpr int64_t kPanel = 64;
constexpr int64_t kChunk = 1024;
// Activation rows per micro-kernel call. PyTorch keeps a compiled micro-kernel for each
// shape it is called with; blocks of at most this many rows bound those shapes to
// kRowBlock per (kc, panel) whatever the row counts of prefill chunks and batches.
constexpr int64_t kRowBlock = 64;

// Weight rows n0..n0+kPanel (rows past w.out as zeros) and inputs k0..k0+kc widened into
// panel [kc / 2][kPanel][2]; ``d`` and ``m`` hold room for the chunk's scales of 16 rows.
void widen_panel(const View& w, int64_t n0, int64_t k0, int64_t kc, uint16_t* panel, float* d,
                 float* m) {
  const int64_t b0 = k0 / kGroup, b1 = (k0 + kc) / kGroup;
  for (int64_t half = 0; half < kPanel; half += 16) {
    // The 16 rows' scales for the chunk's blocks, [block][row]: read as vectors once,
    // not one scalar per row and block.
    scales16(w, n0 + half, b0, b1, d, m);
    const int64_t live = std::min<int64_t>(16, w.out - n0 - half);
    const uint8_t* q0 = w.q + (n0 + half) * w.qstride;
    for (int64_t b = b0; b < b1; ++b) {
      __m512i r[16];
      const float* db = d + (b - b0) * 16;
      const float* mb = m + (b - b0) * 16;
      for (int i = 0; i < 16; ++i) {
        r[i] = i < live ? widen_block_bf16(w.kind, q0 + i * w.qstride, b, db[i], mb[i])
                        : _mm512_setzero_si512();
      }
      transpose16(r);
      // Unit p is inputs 2p, 2p + 1 of the block: pair (b * 16 + p) of the chunk.
      uint16_t* dst = panel + ((b * kGroup - k0) / 2) * kPanel * 2 + half * 2;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * kPanel * 2, r[p]);
    }
  }
}

}  // namespace

void matmul_rows_bf16(const View& w, const float* xp, int64_t rows, float* yp) {
  thread_local std::vector<uint16_t> xb;
  xb.resize(rows * w.in);
  round_rows(xp, rows * w.in, xb.data());
  const auto* a = reinterpret_cast<const at::BFloat16*>(xb.data());
  const int64_t panels = (w.out + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> panel(kChunk * kPanel);
    std::vector<float> d(kChunk / kGroup * 16), m(kChunk / kGroup * 16);
    std::vector<float> edge;  // the last panel's sums when it is narrower than kPanel
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const bool whole = n0 + kPanel <= w.out;
      float* c = yp + n0;
      int64_t ldc = w.out;
      if (!whole) {
        edge.assign(rows * kPanel, 0.0f);
        c = edge.data();
        ldc = kPanel;
      }
      for (int64_t k0 = 0; k0 < w.in; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, w.in - k0);
        widen_panel(w, n0, k0, kc, panel.data(), d.data(), m.data());
        const auto* b = reinterpret_cast<const at::BFloat16*>(panel.data());
        for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
          const int64_t m = std::min(kRowBlock, rows - r0);
          at::native::cpublas::brgemm(m, kPanel, kc, w.in, kPanel, ldc, k0 > 0,
                                      a + r0 * w.in + k0, b, c + r0 * ldc, true);
        }
      }
      if (!whole) {
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(yp + r * w.out + n0, edge.data() + r * kPanel,
                      (w.out - n0) * sizeof(float));
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace quant

#endif
