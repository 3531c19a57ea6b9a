#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL: the kernels touch no Python objects, and a server thread may need it.
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_linear", &block_quant_linear, "residual + prologue(x) (M, K) fp32 @ dequantized GGUF blocks (N, K)^T + bias",
        py::call_guard<py::gil_scoped_release>());
}
