// The C++ CPU kernels of the engine, bound into one extension module (bindings.cpp).
#pragma once
#include <torch/extension.h>

// paged_decode.cpp: one query token per request attends over its KV blocks in place.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);

// int8_linear.cpp: fp32 activations times int8 weights with a scale per group of each row.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias);
