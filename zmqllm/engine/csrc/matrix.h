// A linear layer's weight as the compiled kernels see it: float32, or
// quantized in blocks of 32 weights along the input dimension (quant.h).
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "quant.h"  // MatrixKind, kGroup

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
