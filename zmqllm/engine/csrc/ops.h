// Every op the module exports (bindings.cpp registers them), declared once for the files
// that define and use them.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "gemv.h"    // ZMQLLM_GEMV_AVX512
#include "matrix.h"  // Matrix, matmul, dequantize (quant.cpp)

// The decode sessions of one forward, built once and used by every layer.
// kcache, vcache: per session [num_layers, KVH, max_len, D], contiguous, all float32 or
// all bfloat16 (bf16);
// rows[i]: the row of session i in the flat batch; pos[i]: where its token goes
// in the cache (its past length); lo[i]: the first key it sees (sliding window).
struct DecodeBatch {
  std::vector<torch::Tensor> kcache, vcache;
  std::vector<int64_t> rows, pos, lo;
  bool bf16 = false;

  DecodeBatch(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v, std::vector<int64_t> r,
              std::vector<int64_t> p, std::vector<int64_t> l);  // decode_attention.cpp
};

// decode_attention.cpp
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                      const DecodeBatch& batch, int64_t layer, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor decode_layers(torch::Tensor x, const DecodeBatch& batch,
                            const std::vector<torch::Tensor>& norms,
                            const std::vector<Matrix>& mats, double eps, torch::Tensor cos,
                            torch::Tensor sin, int64_t H, int64_t KVH, int64_t D);

// gemv.cpp. The most rows gemv (and decode_layers, in one call) takes: a speculative pass
// or a few sessions' steps; larger batches take the batched products (linear.py). On
// AVX2 machines 16: there the batched path's packed GEMM and per-layer calls cost 2.6x a
// forward of 8 rows from the ninth row on, while through gemv each row past 8 adds ~6 %
// (the default model on 2 cores: 51 ms at 8 rows, 77 at 16, 143 at 17); on AVX-512
// builds 8, as measured there. Figures: docs/benchmarks.md, "A pass of a few rows".
#if defined(ZMQLLM_GEMV_AVX512)
constexpr int64_t kGemvMaxRows = 8;
#else
constexpr int64_t kGemvMaxRows = 16;
#endif
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w);
