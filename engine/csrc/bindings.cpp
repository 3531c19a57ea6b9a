#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL: the kernels touch no Python objects, and a server thread may need it.
  m.def("block_quant_linear", &block_quant_linear, "residual + prologue(x) (M, K) fp32 @ dequantized GGUF blocks (N, K)^T + bias",
        py::call_guard<py::gil_scoped_release>());
  m.def("kernel_activations", &kernel_activations,
        "prologue(x) (M, K) rounded per block of 32 to 15 bits, or to bf16, as the kernels multiply it",
        py::call_guard<py::gil_scoped_release>());
  m.def("vector_gemm", &vector_gemm,
        "residual + x (M, K) fp32 @ block-quantized weights (parts' rows) + bias, for large batches without AMX",
        py::call_guard<py::gil_scoped_release>());
  m.def("vector_gemm_isa", &vector_gemm_isa, "the instructions vector_gemm's integer products use in this build");
  m.def("vector_gemm_bf16", &vector_gemm_bf16, "whether vector_gemm takes bf16 activations in this build");
  // module_local (the classes): another build of these kernels (another CPU family's, or another revision's)
  // may load beside this one
  py::class_<LoraSlots, std::shared_ptr<LoraSlots>>(m, "LoraSlots", py::module_local(),
                                                  "the LoRA adapters a model holds, by slot (engine/lora.py)")
      .def(py::init<int64_t>())
      .def("set", &LoraSlots::set)
      .def("clear", &LoraSlots::clear)
      .def("add", &LoraSlots::add, py::call_guard<py::gil_scoped_release>());
#if !defined(CBSERVE_MATMULS_ONLY)  // cpu_kernels.TARGETS: the matmuls alone, built for other CPU families
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32 queries, fp32 or fp16 cache)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_gemm_available", &block_quant_gemm_available, "whether block_quant_gemm runs here (AMX bf16 tiles)");
  m.def("block_quant_gemm", &block_quant_gemm,
        "residual + x (M, K) fp32 @ block-quantized weights in AMX tile order + bias, for large batches",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_tile_gemm", &bf16_tile_gemm,
        "residual + bf16(x) (M, K) @ bf16 hi + lo weights in AMX tile order + bias, for large batches",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q (and k) with k and v written to their cache slots",
        py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(),
                          "a decode step through block-quantized decoder layers in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, double, std::vector<int64_t>, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_experts", &DecodeStack::add_experts)
      .def("use_vector_gemm", &DecodeStack::use_vector_gemm)
      .def("use_lora", &DecodeStack::use_lora)
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
#endif
}
