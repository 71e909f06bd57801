// The blocks of gemv (gemv.cpp) per instruction set: four weight rows against a few rows
// of x. Every kernel sums a row's products in one order, the same in each of them:
// 16 partial sums, lane j over the columns k * 16 + j (two 8-lane AVX2 accumulators, or
// one 16-lane AVX-512 one), then (lanes 0-7 + lanes 8-15) reduced by hsum (simd.h), then
// the columns past the last multiple of 16 one by one. So a row gives the same bits
// whatever the other rows of its call and whichever of these kernels ran it.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_GEMV_AVX512 1  // gemv_avx512.cpp
// Rows of x taken together by one call of dot4_rows_avx512: their accumulators, four
// weight rows' loads and their own fill 24 of the 32 vector registers.
constexpr int64_t kGemvXRows = 4;
// y[i * ystride + r] = w[r, :] . x[i, :] for the four weight rows r (rows n floats apart)
// and the first ``rows`` (<= kGemvXRows) rows of x (n floats apart).
void dot4_rows_avx512(const float* w, const float* x, int64_t rows, int64_t n, float* y,
                      int64_t ystride);
#endif
