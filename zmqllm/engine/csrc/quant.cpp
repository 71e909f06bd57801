// Products with int8 and int4 weights (CPU, float32 activations).
//
// A decode step reads every weight once: with 4.5 or 8.5 bits per weight
// instead of 32 it reads 3.8x to 7x fewer bytes. The weights are widened to
// float32 in registers, a block of 32 at a time, and multiplied with the
// float32 activations: nothing is rounded but the sums, so the result is the
// product with the dequantized weight up to the order of the additions.
//   row . x = sum_b d_b * (q_b . x_b) + sum_b m_b * sum(x_b)
// The second sum needs each block's sum of x, computed once per call for all rows.
// Few rows (decode) run through this loop, one weight block widened once for all
// of them; many rows (prefill) dequantize a slice of rows at a time into a
// float32 buffer and multiply it with PyTorch's GEMM.
#include "matrix.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w);  // gemv.cpp

namespace {

// Up to this many rows take the widening loop; more take dequantize + GEMM.
constexpr int64_t kDirectRows = 8;
// Weight rows per task of the widening loop, and per dequantized slice.
constexpr int64_t kGrainRows = 16;
constexpr int64_t kSliceRows = 256;

// One block of weights as 32 floats (the portable path and dequantize).
inline void widen_block(const Matrix& w, int64_t row, int64_t b, float* out) {
  const float d = w.d.data_ptr<float>()[row * (w.in / kGroup) + b];
  const float m = w.has_min() ? w.m.data_ptr<float>()[row * (w.in / kGroup) + b] : 0.0f;
  if (w.kind == MatrixKind::kInt8) {
    const int8_t* q = w.q.data_ptr<int8_t>() + row * w.in + b * kGroup;
    for (int64_t j = 0; j < kGroup; ++j) out[j] = d * static_cast<float>(q[j]) + m;
    return;
  }
  const uint8_t* q = w.q.data_ptr<uint8_t>() + row * (w.in / 2) + b * (kGroup / 2);
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    out[j] = d * static_cast<float>(q[j] & 15) + m;
    out[j + kGroup / 2] = d * static_cast<float>(q[j] >> 4) + m;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The 32 weights of block b as four vectors of 8, without the scale (and minimum).
inline void widen_q(const Matrix& w, const uint8_t* qrow, int64_t b, __m256 v[4]) {
  if (w.kind == MatrixKind::kInt8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + b * kGroup));
    const __m128i lo = _mm256_castsi256_si128(raw);
    const __m128i hi = _mm256_extracti128_si256(raw, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + b * kGroup / 2));
  const __m128i nibble = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, nibble);                      // weights 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);  // weights 16..31
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// y[r, row] for R input rows and one weight row: sum_b d_b * (q_b . x_b), the
// minimum's share left to the caller. x rows are ``in`` apart.
template <int R>
inline void dot_rows(const Matrix& w, int64_t row, const float* x, float* sums) {
  const int64_t groups = w.in / kGroup;
  const int64_t qstride = w.kind == MatrixKind::kInt8 ? w.in : w.in / 2;
  const uint8_t* qrow = static_cast<const uint8_t*>(w.q.data_ptr()) + row * qstride;
  const float* drow = w.d.data_ptr<float>() + row * groups;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    __m256 v[4];
    widen_q(w, qrow, b, v);
    const __m256 d = _mm256_broadcast_ss(drow + b);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * w.in + b * kGroup;
      __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
      t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
      t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
      t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
      acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}
#endif

// The portable row: the same sums from widened blocks.
inline void dot_rows_portable(const Matrix& w, int64_t row, const float* x, int64_t rows,
                              float* sums) {
  float block[kGroup];
  for (int64_t r = 0; r < rows; ++r) sums[r] = 0.0f;
  for (int64_t b = 0; b < w.in / kGroup; ++b) {
    widen_block(w, row, b, block);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * w.in + b * kGroup;
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += block[j] * xb[j];
      sums[r] += s;
    }
  }
}

// Few rows: y [rows, out] through the widening loop.
torch::Tensor matmul_direct(const torch::Tensor& x, const Matrix& w) {
  const int64_t rows = x.size(0);
  const int64_t groups = w.in / kGroup;
  torch::Tensor y = torch::empty({rows, w.out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each block's sum of x, [rows, groups], for the minimum's share.
  std::vector<float> xsum;
  if (w.has_min()) {
    xsum.resize(rows * groups);
    for (int64_t i = 0; i < rows * groups; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
      xsum[i] = s;
    }
  }
  at::parallel_for(0, w.out, kGrainRows, [&](int64_t r0, int64_t r1) {
    float sums[kDirectRows];
    for (int64_t row = r0; row < r1; ++row) {
#if defined(__AVX2__) && defined(__FMA__)
      for (int64_t r = 0; r < rows; r += 4) {
        const float* xr = xp + r * w.in;
        switch (std::min<int64_t>(4, rows - r)) {
          case 1: dot_rows<1>(w, row, xr, sums + r); break;
          case 2: dot_rows<2>(w, row, xr, sums + r); break;
          case 3: dot_rows<3>(w, row, xr, sums + r); break;
          default: dot_rows<4>(w, row, xr, sums + r); break;
        }
      }
#else
      dot_rows_portable(w, row, xp, rows, sums);
#endif
      if (w.has_min()) {
        const float* mrow = w.m.data_ptr<float>() + row * groups;
        for (int64_t r = 0; r < rows; ++r) {
          float s = 0.0f;
          for (int64_t b = 0; b < groups; ++b) s += mrow[b] * xsum[r * groups + b];
          sums[r] += s;
        }
      }
      for (int64_t r = 0; r < rows; ++r) yp[r * w.out + row] = sums[r];
    }
  });
  return y;
}

void dequantize_rows(const Matrix& w, int64_t r0, int64_t r1, float* out) {
  at::parallel_for(r0, r1, kGrainRows, [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) {
      for (int64_t g = 0; g < w.in / kGroup; ++g) {
        widen_block(w, row, g, out + (row - r0) * w.in + g * kGroup);
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
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.sizes() == groups,
              "Matrix: one float32 scale per block of 32 weights, [out, in / 32]");
  TORCH_CHECK(kind == MatrixKind::kInt8 || m.numel() > 0, "Matrix: int4 needs its minimums");
  if (m.numel() > 0) {
    TORCH_CHECK(m.scalar_type() == torch::kFloat && m.is_contiguous() && m.sizes() == groups,
                "Matrix: one float32 minimum per block of 32 weights, [out, in / 32]");
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
  torch::Tensor out = torch::empty({w.out, w.in}, w.d.options());
  dequantize_rows(w, 0, w.out, out.data_ptr<float>());
  return out;
}
