// One row (or a few) times a float32 weight matrix, for decode (CPU).
//
// At one row a linear layer is a matrix-vector product: every weight is read
// once and used once, so its speed is the memory read bandwidth. PyTorch's
// float32 path for one row does not reach it on every CPU; this loop streams
// four weight rows at a time against x (which stays in L1), in parallel over
// blocks of output rows.
#include "gemv.h"
#include "ops.h"
#include "simd.h"  // hsum

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRowsPerBlock = 4;
// Blocks of rows per task: below this a task costs more to hand out than to run.
constexpr int64_t kGrainBlocks = 16;

#if defined(__AVX2__) && defined(__FMA__)

// y[r] = w[r, :] . x for four consecutive rows; n is the row length.
inline void dot4(const float* w, const float* x, int64_t n, float* y) {
  const float* w0 = w;
  const float* w1 = w + n;
  const float* w2 = w + 2 * n;
  const float* w3 = w + 3 * n;
  // Two accumulators per row hide the FMA latency; x is loaded once for four rows.
  __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
  __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps();
  __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 xa = _mm256_loadu_ps(x + i);
    const __m256 xb = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xa, a0);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), xb, b0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xa, a1);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), xb, b1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xa, a2);
    b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), xb, b2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xa, a3);
    b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), xb, b3);
  }
  float s0 = hsum(_mm256_add_ps(a0, b0));
  float s1 = hsum(_mm256_add_ps(a1, b1));
  float s2 = hsum(_mm256_add_ps(a2, b2));
  float s3 = hsum(_mm256_add_ps(a3, b3));
  for (; i < n; ++i) {
    s0 += w0[i] * x[i];
    s1 += w1[i] * x[i];
    s2 += w2[i] * x[i];
    s3 += w3[i] * x[i];
  }
  y[0] = s0;
  y[1] = s1;
  y[2] = s2;
  y[3] = s3;
}
#endif

// The portable row: eight independent partial sums the compiler may vectorize.
inline float dot1(const float* w, const float* x, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t l = 0; l < 8; ++l) acc[l] += w[i + l] * x[i + l];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += w[i] * x[i];
  return s;
}

}  // namespace

// x [rows, in] @ w[out, in]^T -> [rows, out], float32, both contiguous, rows at most
// kGemvMaxRows. Each block of four weight rows is read from memory once and kept in L1
// while every row of x goes through it: a few rows (a speculative pass's proposals)
// cost about what one does. Every row's sums run in one order whatever the row count,
// so a row's result is the same bits alone or among others.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "gemv: float32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kGemvMaxRows && w.dim() == 2 &&
                  w.size(1) == x.size(1),
              "gemv: x must be [rows, in] (1 <= rows <= ", kGemvMaxRows, ") and w [out, in]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv: contiguous tensors only");
  const int64_t rows = x.size(0);
  const int64_t out = w.size(0);
  const int64_t n = w.size(1);
  torch::Tensor y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (out + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * kRowsPerBlock;
#if defined(ZMQLLM_GEMV_AVX512)
      if (r + kRowsPerBlock <= out) {
        for (int64_t i = 0; i < rows; i += kGemvXRows) {
          const int64_t take = std::min(kGemvXRows, rows - i);
          dot4_rows_avx512(wp + r * n, xp + i * n, take, n, yp + i * out + r, out);
        }
        continue;
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if (r + kRowsPerBlock <= out) {
        for (int64_t i = 0; i < rows; ++i) dot4(wp + r * n, xp + i * n, n, yp + i * out + r);
        continue;
      }
#endif
      const int64_t end = std::min(r + kRowsPerBlock, out);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = r; j < end; ++j) yp[i * out + j] = dot1(wp + j * n, xp + i * n, n);
      }
    }
  });
  return y;
}
