// A linear layer's weight as the compiled kernels see it: float32, or
// quantized in blocks of 32 weights along the input dimension (quant.h).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

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

// x [rows, in] @ W^T -> [rows, out] float32; any row count, the path chosen by it.
torch::Tensor matmul(const torch::Tensor& x, const Matrix& w);
// The same through a named path of a quantized Matrix: "direct" (up to 16 rows),
// "chunks", "dequant", "bf16" (on our AMX kernel where the tiles are granted, else as
// "brgemm": oneDNN's micro-kernel), "codes" (int8 or int4 on AVX512_BF16: quant_codes.cpp) or
// "vnni" (where built).
torch::Tensor matmul_path(const torch::Tensor& x, const Matrix& w, const std::string& path);
// The path matmul takes for ``rows`` rows.
std::string matmul_choice(const Matrix& w, int64_t rows);
// Whether this build has the bfloat16 matrix-unit path and the 8-bit-activation VNNI
// path; turning them off or on (VNNI only with ``on`` and ``vnni``); the units the
// products of several rows use now ("" when none: "avx512_vnni", then "amx" or
// "avx512_bf16", comma-separated).
bool bf16_built();
bool vnni_built();
void set_matrix_units(bool on, bool vnni);
std::string matrix_units();
// The weight as float32 [out, in].
torch::Tensor dequantize(const Matrix& w);
