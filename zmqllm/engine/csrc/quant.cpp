// Products with int8 and int4 weights (CPU, float32 activations): the Matrix, the
// choice between the widening loop and dequantize + GEMM, and the portable kernel.
//
// A decode step reads every weight once: with 6 or 10 bits per weight (codes,
// scale and minimum) instead of 32 it reads 3 to 5x fewer bytes. Few rows meet
// the weights in one pass of the widening loop of the instruction set this build
// has (quant.h says which: quant_avx512.cpp, quant_avx2.cpp, or the portable one
// below); many rows (prefill) dequantize a slice of rows at a time into a float32
// buffer and multiply it with PyTorch's GEMM.
#include "matrix.h"
#include "ops.h"  // gemv
#include "quant.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>  // init_amx

#include <algorithm>
#include <vector>

namespace quant {

View::View(const Matrix& w)
    : kind(w.kind),
      q(static_cast<const uint8_t*>(w.q.data_ptr())),
      d(w.d.data_ptr()),
      m(w.has_min() ? w.m.data_ptr() : nullptr),
      half(w.half_scales()),
      out(w.out),
      in(w.in),
      groups(w.in / kGroup),
      qstride(w.kind == MatrixKind::kInt8 ? w.in : w.in / 2) {}

namespace {

// The portable row: the same sums from widened blocks.
inline void dot_rows_portable(const View& w, const RowScales& s, int64_t row, const float* x,
                              int64_t rows, float* sums) {
  float block[kGroup];
  for (int64_t r = 0; r < rows; ++r) sums[r] = 0.0f;
  for (int64_t b = 0; b < w.groups; ++b) {
    widen_block(w, s, row, b, block);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * w.in + b * kGroup;
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += block[j] * xb[j];
      sums[r] += s;
    }
  }
}

}  // namespace

void matmul_rows_generic(const View& w, const float* xp, int64_t rows, float* yp) {
  const int64_t out = w.out;
  const int64_t groups = w.groups;
  // Each block's sum of x, [rows, groups], for the offset's share. Kept per calling
  // thread: a decode step makes over a hundred of these calls.
  thread_local std::vector<float> xsum;
  xsum.resize(w.m != nullptr ? rows * groups : 0);
  // A pointer, not the thread_local name: inside the tasks below that would name the
  // pool threads' own (empty) buffer.
  const float* xsp = xsum.data();
  if (w.m != nullptr) {
    for (int64_t i = 0; i < rows * groups; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
      xsum[i] = s;
    }
  }
  at::parallel_for(0, out, kGrainRows, [&](int64_t r0, int64_t r1) {
    float sums[kDirectRows];
    std::vector<float> dbuf(w.half ? groups : 0), mbuf(w.half ? groups : 0);
    for (int64_t row = r0; row < r1; ++row) {
      const RowScales rs(w, row, dbuf.data(), mbuf.data());
      dot_rows_portable(w, rs, row, xp, rows, sums);
      if (rs.m != nullptr) {
        const float* mrow = rs.m;
        for (int64_t r = 0; r < rows; ++r) {
          float s = 0.0f;
          for (int64_t b = 0; b < groups; ++b) s += mrow[b] * xsp[r * groups + b];
          sums[r] += s;
        }
      }
      for (int64_t r = 0; r < rows; ++r) yp[r * out + row] = sums[r];
    }
  });
}

}  // namespace quant

namespace {

// Up to kDirectRows rows take the widening loop in one pass over the weights; up to
// kGemmRows, that loop kDirectRows at a time; more, dequantize + GEMM (docs/scale.md
// has the figures that set these).
constexpr int64_t kDirectRows = quant::kDirectRows;
constexpr int64_t kGemmRows = 128;
// From this many rows the bfloat16 matrix-unit path where built (docs/scale.md): on
// AVX512_BF16 alone, 8; on AMX tiles (quant_amx.cpp: one widening pass over the weights
// costs about two one-row passes of the direct loop, the tiles' products next to nothing
// up to ~64 rows), 6.
constexpr int64_t kBf16Rows = 8;
constexpr int64_t kBf16AmxRows = 6;
// From this many rows 8-bit activations on VNNI, where built and asked for: a repacked
// panel costs about 1.5 one-row passes over the weights, each row then a fifth of one.
// The 16-bit widening loop stays below it (one-row decode keeps its 16-bit activations).
constexpr int64_t kVnniRows = 5;
// From this many rows AMX tiles in bfloat16 beat VNNI (their widening costs about the
// repacking plus a few VNNI rows, their products next to nothing); without AMX, VNNI for
// every row count.
constexpr int64_t kAmxRows = 12;
// Which of the two takes a product on AVX512_BF16 without AMX: the codes path
// (quant_codes.cpp: no weight widened to its value, 16 rows a vector) costs about the
// same for every group of 16 rows, a last partial group as a whole one; oneDNN's
// micro-kernel widens the weights once per call and then costs little per row. One 7B
// layer on Zen 4 (docs/scale.md): a group ~21.5 ms, oneDNN's ~20 ms plus ~1 a row, so
// the codes path takes 8-16 and 24-32 rows, oneDNN's the rest (int8 alike). From three
// groups the two measured within noise of each other at best (45-48 rows), so oneDNN's.
constexpr bool codes_wins(int64_t rows) {
  const int64_t groups = (rows + 15) / 16;
  // 21.5 ms a group < 20 ms + 1 ms a row, doubled.
  return groups <= 2 && 43 * groups < 40 + 2 * rows;
}
// Weight rows per dequantized slice.
constexpr int64_t kSliceRows = 256;

// Few rows: y [rows, out] through the widening loop of this build's instruction set.
torch::Tensor matmul_direct(const torch::Tensor& x, const Matrix& matrix) {
  const quant::View w(matrix);
  const int64_t rows = x.size(0);
  torch::Tensor y = torch::empty({rows, matrix.out}, x.options());
#if defined(ZMQLLM_QUANT_AVX512)
  quant::matmul_rows_avx512(w, x.data_ptr<float>(), rows, y.data_ptr<float>());
#elif defined(ZMQLLM_QUANT_AVX2)
  quant::matmul_rows_avx2(w, x.data_ptr<float>(), rows, y.data_ptr<float>());
#else
  quant::matmul_rows_generic(w, x.data_ptr<float>(), rows, y.data_ptr<float>());
#endif
  return y;
}

void dequantize_rows(const Matrix& matrix, int64_t r0, int64_t r1, float* out) {
  const quant::View w(matrix);
  at::parallel_for(r0, r1, quant::kGrainRows, [&](int64_t a, int64_t b) {
    std::vector<float> dbuf(w.half ? w.groups : 0), mbuf(w.half ? w.groups : 0);
    for (int64_t row = a; row < b; ++row) {
      const quant::RowScales rs(w, row, dbuf.data(), mbuf.data());
      for (int64_t g = 0; g < w.in / kGroup; ++g) {
        quant::widen_block(w, rs, row, g, out + (row - r0) * w.in + g * kGroup);
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
  const auto scale = d.scalar_type();
  TORCH_CHECK((scale == torch::kFloat || scale == torch::kHalf) && d.is_contiguous() &&
                  d.sizes() == groups,
              "Matrix: one float32 or float16 scale per block of 32 weights, [out, in / 32]");
  TORCH_CHECK(kind == MatrixKind::kInt8 || m.numel() > 0, "Matrix: int4 needs its minimums");
  if (m.numel() > 0) {
    TORCH_CHECK(m.scalar_type() == scale && m.is_contiguous() && m.sizes() == groups,
                "Matrix: one minimum per block of 32 weights, [out, in / 32], of the scales' dtype");
  }
}

// The product's paths for a quantized Matrix, by row count (matmul chooses; matmul_path
// runs a named one, for the benchmarks and the tests that hold each to its reference).
// kBf16 runs on AMX tiles with quant_amx.cpp's micro-kernel where it can, else oneDNN's
// (kBrgemm, which the tests and benchmarks also name to hold it on AMX machines).
enum class Path { kDirect, kChunks, kDequant, kBf16, kVnni, kBrgemm, kCodes };

bool bf16_built() {
#if defined(ZMQLLM_QUANT_BF16)
  return true;
#else
  return false;
#endif
}

bool vnni_built() {
#if defined(ZMQLLM_QUANT_VNNI)
  return true;
#else
  return false;
#endif
}

namespace {

// set_matrix_units turns these on (where built) and off.
bool g_bf16 = bf16_built();
bool g_vnni = false;
// Whether the bfloat16 products run on AMX tiles: the CPU has them and Linux granted
// this process their state (oneDNN's micro-kernel falls back to AVX512_BF16 otherwise).
bool amx_tiles() {
  static const bool granted = bf16_built() && at::cpu::init_amx();
  return granted;
}

Path choose_path(int64_t rows) {
  if (g_vnni && rows >= kVnniRows) {
    return g_bf16 && rows >= kAmxRows && amx_tiles() ? Path::kBf16 : Path::kVnni;
  }
  if (g_bf16 && rows >= (amx_tiles() ? kBf16AmxRows : kBf16Rows)) {
    return !amx_tiles() && codes_wins(rows) ? Path::kCodes : Path::kBf16;
  }
  if (rows <= kDirectRows) return Path::kDirect;
  return rows < kGemmRows ? Path::kChunks : Path::kDequant;
}

torch::Tensor run_path(const torch::Tensor& x, const Matrix& w, Path path) {
  const int64_t rows = x.size(0);
  torch::Tensor y = torch::empty({rows, w.out}, x.options());
  switch (path) {
    case Path::kDirect:
      return matmul_direct(x, w);
    case Path::kChunks:  // kDirectRows at a time, each chunk reading the weights once more
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        const int64_t n = std::min(kDirectRows, rows - r0);
        y.narrow(0, r0, n).copy_(matmul_direct(x.narrow(0, r0, n), w));
      }
      return y;
    case Path::kBf16:
#if defined(ZMQLLM_QUANT_AMX)
      if (amx_tiles()) {
        quant::matmul_rows_amx(quant::View(w), x.data_ptr<float>(), rows, y.data_ptr<float>());
        return y;
      }
#endif
      [[fallthrough]];
    case Path::kBrgemm:
#if defined(ZMQLLM_QUANT_BF16)
      quant::matmul_rows_bf16(quant::View(w), x.data_ptr<float>(), rows, y.data_ptr<float>());
      return y;
#else
      TORCH_CHECK(false, "matmul: this build has no bfloat16 matrix-unit path");
#endif
    case Path::kCodes:
#if defined(ZMQLLM_QUANT_BF16)
      quant::matmul_rows_codes(quant::View(w), x.data_ptr<float>(), rows, y.data_ptr<float>());
      return y;
#else
      TORCH_CHECK(false, "matmul: this build has no bfloat16 matrix-unit path");
#endif
    case Path::kVnni:
#if defined(ZMQLLM_QUANT_VNNI)
      quant::matmul_rows_vnni(quant::View(w), x.data_ptr<float>(), rows, y.data_ptr<float>());
      return y;
#else
      TORCH_CHECK(false, "matmul: this build has no VNNI path");
#endif
    case Path::kDequant:
      break;
  }
  torch::Tensor slice = torch::empty({std::min(kSliceRows, w.out), w.in}, x.options());
  for (int64_t r0 = 0; r0 < w.out; r0 += kSliceRows) {
    const int64_t r1 = std::min(r0 + kSliceRows, w.out);
    dequantize_rows(w, r0, r1, slice.data_ptr<float>());
    y.narrow(1, r0, r1 - r0).copy_(torch::mm(x, slice.narrow(0, 0, r1 - r0).t()));
  }
  return y;
}

torch::Tensor checked(const torch::Tensor& x, const Matrix& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == w.in &&
                  x.device().is_cpu(),
              "matmul: x must be float32 [rows, ", w.in, "] on the CPU");
  return x.contiguous();
}

}  // namespace

void set_matrix_units(bool on, bool vnni) {
  g_bf16 = on && bf16_built();
  g_vnni = on && vnni && vnni_built();
}

std::string matrix_units() {
  std::string units;
  if (g_vnni) units = "avx512_vnni";
  if (g_bf16) units += std::string(units.empty() ? "" : ",") + (amx_tiles() ? "amx" : "avx512_bf16");
  return units;
}

std::string matmul_choice(const Matrix& w, int64_t rows) {
  if (w.kind == MatrixKind::kFloat32) return rows <= kGemvMaxRows ? "gemv" : "linear";
  static const char* names[] = {"direct", "chunks", "dequant", "bf16", "vnni", "brgemm", "codes"};
  return names[static_cast<int>(choose_path(rows))];
}

torch::Tensor matmul(const torch::Tensor& x_, const Matrix& w) {
  const torch::Tensor x = checked(x_, w);
  if (w.kind == MatrixKind::kFloat32) {
    return x.size(0) <= kGemvMaxRows ? gemv(x, w.q) : torch::linear(x, w.q);
  }
  return run_path(x, w, choose_path(x.size(0)));
}

torch::Tensor matmul_path(const torch::Tensor& x_, const Matrix& w, const std::string& name) {
  const torch::Tensor x = checked(x_, w);
  TORCH_CHECK(w.kind != MatrixKind::kFloat32, "matmul_path: an int8 or int4 Matrix");
  const Path path = name == "direct"  ? Path::kDirect
                    : name == "chunks" ? Path::kChunks
                    : name == "dequant" ? Path::kDequant
                    : name == "bf16"    ? Path::kBf16
                    : name == "vnni"    ? Path::kVnni
                    : name == "brgemm"  ? Path::kBrgemm
                    : name == "codes"   ? Path::kCodes
                                        : throw std::invalid_argument("matmul_path: unknown path");
  TORCH_CHECK(path != Path::kDirect || x.size(0) <= kDirectRows, "matmul_path: direct takes up to ",
              kDirectRows, " rows");
  return run_path(x, w, path);
}

torch::Tensor dequantize(const Matrix& w) {
  if (w.kind == MatrixKind::kFloat32) return w.q.clone();
  torch::Tensor out = torch::empty({w.out, w.in}, w.d.options().dtype(torch::kFloat));
  dequantize_rows(w, 0, w.out, out.data_ptr<float>());
  return out;
}
