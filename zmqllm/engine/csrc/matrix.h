// A linear layer's weight as the compiled kernels see it: float32, or
// quantized in blocks of 32 weights along the input dimension.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The sum of a vector's eight lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

enum class MatrixKind : int64_t {
  kFloat32 = 0,  // w [out, in] float32
  kInt8 = 1,     // q int8 [out, in], d [out, in / 32], m as d or empty: w = d * q + m
  kInt4 = 2,     // q uint8 [out, in / 2], d and m [out, in / 32]: w = d * q + m
};
// d and m are float32, or float16 as GGUF's blocks hold them (Q4_1: 20 bytes a block of
// 32 weights instead of 24): a decode step reads every byte of them once, so the
// narrower scales are a sixth less to read. They widen a row at a time (RowScales).

// Inside a block of 32 int4 weights, byte j holds weight j (low nibble) and
// weight j + 16 (high nibble): GGUF's Q4_1 layout, so its blocks load as they are.
constexpr int64_t kGroup = 32;

struct Matrix {
  MatrixKind kind;
  torch::Tensor q;  // the float32 weight for kFloat32
  torch::Tensor d;
  torch::Tensor m;
  int64_t out;
  int64_t in;

  Matrix(int64_t kind, torch::Tensor q, torch::Tensor d, torch::Tensor m);
  bool has_min() const { return kind != MatrixKind::kFloat32 && m.numel() > 0; }
  bool half_scales() const { return kind != MatrixKind::kFloat32 && d.scalar_type() == torch::kHalf; }
};

// x [rows, in] @ W^T -> [rows, out] float32; any row count.
torch::Tensor matmul(const torch::Tensor& x, const Matrix& w);
// The weight as float32 [out, in].
torch::Tensor dequantize(const Matrix& w);
