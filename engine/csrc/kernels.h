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

// block_quant_linear.cpp: x (M, K) rounded per block of 32 as the kernel rounds it (q * d), for
// the fp32 GEMM path of larger batches.
torch::Tensor quantize_activations(const torch::Tensor& x);

// decode_stack.cpp: a decode step (one token per request) through a stack of block-quantized
// Llama layers, each layer's four matmuls (qkv, o, gate_up, down: block_quant_linear's rows,
// formats and biases) and two RMSNorm weights (input, post-attention) held from construction.
class DecodeStack {
 public:
  static constexpr int64_t kMatmuls = 4;
  DecodeStack(std::vector<torch::Tensor> rows, std::vector<int64_t> formats,
              std::vector<c10::optional<torch::Tensor>> biases, std::vector<torch::Tensor> norms, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps);
  int64_t num_layers() const;
  // hidden (T, hidden) through the first num_layers layers; cos/sin (T, head_dim) at the tokens'
  // positions (sin's first half negated); kv_cache (layers, 2, kv_heads, blocks, block_size,
  // head_dim) written at slot_mapping (T); block_tables (T, max blocks), seq_lens (T) and the
  // attention scale as for paged_decode_attention.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                        int64_t num_layers) const;

 private:
  std::vector<torch::Tensor> rows_;
  std::vector<int64_t> formats_;
  std::vector<c10::optional<torch::Tensor>> biases_;
  std::vector<torch::Tensor> norms_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
};
