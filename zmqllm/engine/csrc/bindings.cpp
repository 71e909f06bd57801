// The Python module: every op of the compiled kernels, registered in one place. The
// ops live in decode_attention.cpp, gemv.cpp and quant.cpp (declared in ops.h).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeBatch>(m, "DecodeBatch")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>());
  m.def("decode_attention", &decode_attention,
        "write one new key/value row per session and attend, all sessions in one call");
  m.def("rms_norm", &rms_norm, "w * (x * rsqrt(mean(x^2) + eps)) per row");
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("gemv", &gemv, "x [rows, in] @ w[out, in]^T, float32, a few rows");
  m.attr("GEMV_MAX_ROWS") = kGemvMaxRows;
  pybind11::class_<Matrix>(m, "Matrix")
      .def(pybind11::init<int64_t, torch::Tensor, torch::Tensor, torch::Tensor>())
      .def_readonly("out", &Matrix::out)
      .def_readonly("inp", &Matrix::in);
  m.def("matmul", &matmul, "x [rows, in] @ W^T for a float32, int8 or int4 Matrix");
  m.def("matmul_path", &matmul_path, "x @ W^T through a named path of a quantized Matrix");
  m.def("matmul_choice", &matmul_choice, "the path matmul takes for a row count");
  m.def("bf16_built", &bf16_built, "whether the bfloat16 matrix-unit path is built");
  m.def("vnni_built", &vnni_built, "whether the 8-bit-activation VNNI path is built");
  m.def("set_matrix_units", &set_matrix_units, "use the bfloat16 and VNNI paths (where built)",
        pybind11::arg("on"), pybind11::arg("vnni") = false);
  m.def("matrix_units", &matrix_units, "the units the products of many rows use now");
  m.def("dequantize", &dequantize, "a Matrix's weight as float32 [out, in]");
  m.def("decode_layers", &decode_layers, "a few decode rows through consecutive layers");
}
