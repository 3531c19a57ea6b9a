// The C++ CPU kernels of the engine, bound into one extension module (bindings.cpp).
#pragma once
#include <torch/extension.h>

// paged_decode.cpp: one query token per request attends over its KV blocks in place.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);

// block_quant_linear.cpp: residual + prologue(x) (quantized per block of 32 inside) times GGUF Q8_0
// (format 0) or Q4_1 (format 1) weight blocks (N, K / 32 * block bytes) + bias; the prologue is
// RMSNorm with norm_weight, SwiGLU, or none.
torch::Tensor block_quant_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t format,
                                 const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                                 const c10::optional<torch::Tensor>& residual);
