#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL: the kernels touch no Python objects, and a server thread may need it.
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &int8_linear, "x (M, K) fp32 @ (int8 weight (N, K) * group scales (N, K / G))^T + bias",
        py::call_guard<py::gil_scoped_release>());
}
