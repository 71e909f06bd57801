// Quantized weights as the kernels read them, what the kernels of every instruction set
// share, and which of them this build runs. No torch here but c10's float16: the
// instruction-set files (quant_avx2.cpp, quant_avx512.cpp) work on raw pointers.
//
// A product with int8 or int4 weights and float32 activations, per weight row:
//   row . x = sum_b d_b * (q_b . x_b) + sum_b m_b * sum(x_b)
// The second sum needs each block's sum of x, computed once per call for all rows.
// Few rows (decode) take a loop that widens each weight block once for all of them
// (matmul_rows_*); many rows (prefill) dequantize a slice of weight rows at a time and
// multiply it with PyTorch's GEMM (quant.cpp).
//
// Like ggml-cpu's quants.c and arch/x86/quants.c: quant.cpp holds the portable kernel
// and everything above the kernels, each instruction set's kernel has a file of its own
// compiled to nothing where the target lacks it, and the one to run is chosen at compile
// time below (the build is -march=native, so: from the CPU it runs on).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_QUANT_AVX512 1  // quant_avx512.cpp (it also uses quant_avx2.h)
#elif defined(__AVX2__) && defined(__FMA__)
#define ZMQLLM_QUANT_AVX2 1  // quant_avx2.cpp
#endif                       // neither: matmul_rows_generic (quant.cpp)
// Many rows on the 16-bit matrix units (AMX or AVX512_BF16): quant_bf16.cpp.
#if defined(ZMQLLM_QUANT_AVX512) && defined(__AVX512BF16__)
#define ZMQLLM_QUANT_BF16 1
#endif
// The same on AMX tiles with a micro-kernel of our own: quant_amx.cpp.
#if defined(ZMQLLM_QUANT_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ZMQLLM_QUANT_AMX 1
#endif
// Several rows with 8-bit activations on AVX-512 VNNI: quant_vnni.cpp.
#if defined(ZMQLLM_QUANT_AVX512) && defined(__AVX512VNNI__)
#define ZMQLLM_QUANT_VNNI 1
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

struct Matrix;  // matrix.h

namespace quant {

// Up to kDirectRows rows take the widening loop in one pass over the weights (the
// crossover with dequantize + GEMM is measured in docs/scale.md).
constexpr int64_t kDirectRows = 16;
// Weight rows per task of the widening loop, and of dequantizing.
constexpr int64_t kGrainRows = 16;

// Raw pointers of a Matrix, taken once per call: data_ptr<T>() checks its type on
// every call, which per weight row cost more than the row's arithmetic.
struct View {
  MatrixKind kind;
  const uint8_t* q;
  const void* d;
  const void* m;  // null without offsets
  bool half;      // d and m are float16
  int64_t out;
  int64_t in;
  int64_t groups;
  int64_t qstride;  // bytes per weight row

  explicit View(const Matrix& w);  // quant.cpp
};

// n float16 values as float32.
inline void widen_half(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}

// One weight row's scales and offsets as float32: pointers into the Matrix when it holds
// float32, else widened into buffers of the caller's (``groups`` floats each).
struct RowScales {
  const float* d;
  const float* m;  // null without offsets

  RowScales(const View& w, int64_t row, float* dbuf, float* mbuf) {
    const int64_t at = row * w.groups;
    if (!w.half) {
      d = static_cast<const float*>(w.d) + at;
      m = w.m != nullptr ? static_cast<const float*>(w.m) + at : nullptr;
      return;
    }
    widen_half(static_cast<const uint16_t*>(w.d) + at, w.groups, dbuf);
    d = dbuf;
    m = nullptr;
    if (w.m != nullptr) {
      widen_half(static_cast<const uint16_t*>(w.m) + at, w.groups, mbuf);
      m = mbuf;
    }
  }
};

// One block of weights as 32 floats (the portable kernel and dequantize).
inline void widen_block(const View& w, const RowScales& s, int64_t row, int64_t b, float* out) {
  const float d = s.d[b];
  const float m = s.m != nullptr ? s.m[b] : 0.0f;
  if (w.kind == MatrixKind::kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + row * w.in + b * kGroup;
    for (int64_t j = 0; j < kGroup; ++j) out[j] = d * static_cast<float>(q[j]) + m;
    return;
  }
  const uint8_t* q = w.q + row * w.qstride + b * (kGroup / 2);
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    out[j] = d * static_cast<float>(q[j] & 15) + m;
    out[j + kGroup / 2] = d * static_cast<float>(q[j] >> 4) + m;
  }
}

// y [rows, out] = x [rows, in] @ W^T for 1 to kDirectRows rows, x and y contiguous
// float32, W int8 or int4: the widening loop, one per instruction set. Only the one
// selected above is defined in a build; the portable one always is.
void matmul_rows_generic(const View& w, const float* x, int64_t rows, float* y);  // quant.cpp
void matmul_rows_avx2(const View& w, const float* x, int64_t rows, float* y);  // quant_avx2.cpp
void matmul_rows_avx512(const View& w, const float* x, int64_t rows, float* y);  // quant_avx512.cpp
// The same product for any row count through bfloat16 (weights and activations rounded
// to it, float32 sums) on the matrix units: defined where ZMQLLM_QUANT_BF16 is.
void matmul_rows_bf16(const View& w, const float* x, int64_t rows, float* y);  // quant_bf16.cpp
// The same for any row count with the codes as exact bfloat16 (int4: 128 + q; int8: q) in
// vdpbf16ps, 16 rows a vector, each block's scale applied to its sums: defined where
// ZMQLLM_QUANT_BF16 is.
void matmul_rows_codes(const View& w, const float* x, int64_t rows, float* y);  // quant_codes.cpp
// The same numbers on AMX tiles (the process must hold their state: at::cpu::init_amx):
// defined where ZMQLLM_QUANT_AMX is.
void matmul_rows_amx(const View& w, const float* x, int64_t rows, float* y);  // quant_amx.cpp
// The same with activations quantized to int8 per block of 32 and integer products on
// AVX-512 VNNI: defined where ZMQLLM_QUANT_VNNI is.
void matmul_rows_vnni(const View& w, const float* x, int64_t rows, float* y);  // quant_vnni.cpp

}  // namespace quant
