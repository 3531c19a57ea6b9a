// A decode step through a Llama-family stack of block-quantized layers in one call: per layer,
// the step's KV slots asked for ahead (prefetch_kv_slots), RMSNorm + qkv (block_quant_linear), RoPE on q and k with k and v written to their cache slots
// (rope_write_kv), paged attention (paged_decode_attention), o + residual, RMSNorm + gate/up,
// SwiGLU + down + residual:
// engine/models/llama.py's LlamaLayer.forward, with the same kernels and the same arithmetic (past
// kernel_rows tokens the vector GEMM, as BlockQuantLinear runs it). At one token the Python
// path's per-op overhead (about twenty torch ops and module calls per layer) costs as much as the
// matmuls; here a step makes one call.
#include "kernels.h"

DecodeStack::DecodeStack(std::vector<torch::Tensor> rows, std::vector<int64_t> formats,
                         std::vector<c10::optional<torch::Tensor>> biases, std::vector<torch::Tensor> norms,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         std::vector<c10::optional<torch::Tensor>> tiles,
                         std::vector<c10::optional<torch::Tensor>> scales,
                         std::vector<c10::optional<torch::Tensor>> offsets, int64_t kernel_rows)
    : rows_(std::move(rows)), formats_(std::move(formats)), biases_(std::move(biases)), norms_(std::move(norms)),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), tiles_(std::move(tiles)),
      scales_(std::move(scales)), offsets_(std::move(offsets)), kernel_rows_(kernel_rows) {
  TORCH_CHECK(rows_.size() % kMatmuls == 0 && formats_.size() == rows_.size() && biases_.size() == rows_.size() &&
                  norms_.size() == rows_.size() / kMatmuls * 2,
              "per layer: four matmuls (qkv, o, gate_up, down) and two norms (input, post-attention)");
  TORCH_CHECK(tiles_.size() == rows_.size() && scales_.size() == rows_.size() && offsets_.size() == rows_.size(),
              "tiles, scales, offsets: one (or None) per matmul");
  for (size_t i = 0; i < tiles_.size(); ++i)
    TORCH_CHECK(tiles_[i].has_value() == scales_[i].has_value(), "a matmul's tiles come with its scales");
}

torch::Tensor DecodeStack::matmul(int64_t i, const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight,
                                  bool swiglu, const c10::optional<torch::Tensor>& residual) const {
  if (tiles_[i].has_value() && x.size(0) > kernel_rows_)
    return vector_gemm(x, *tiles_[i], *scales_[i], offsets_[i], biases_[i], norm_weight, eps_, swiglu, residual);
  return block_quant_linear(x, rows_[i], formats_[i], biases_[i], norm_weight, eps_, swiglu, residual);
}

int64_t DecodeStack::num_layers() const { return static_cast<int64_t>(rows_.size()) / kMatmuls; }

torch::Tensor DecodeStack::forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                   int64_t num_layers) const {
  const int64_t T = hidden.size(0), D = head_dim_, H = num_heads_, KVH = num_kv_heads_;
  TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "num_layers: at most the stack's");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos, sin: contiguous (T, head_dim)");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat, "hidden, cos, sin: fp32");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat || kv_cache.scalar_type() == torch::kHalf,
              "kv_cache: fp32 or fp16");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(2) == KVH && kv_cache.size(5) == D,
              "kv_cache: contiguous (layers, 2, kv_heads, blocks, block_size, head_dim)");
  hidden = hidden.contiguous();
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t i = l * kMatmuls;
    const torch::Tensor layer_cache = kv_cache[l];
    prefetch_kv_slots(layer_cache, slot_mapping);
    const torch::Tensor qkv = matmul(i, hidden, norms_[2 * l], false, c10::nullopt);
    const torch::Tensor q = rope_write_kv(qkv, cos, sin, layer_cache, slot_mapping, H, false);
    const torch::Tensor attn = paged_decode_attention(q, layer_cache, block_tables, seq_lens, scale).view({T, H * D});
    hidden = matmul(i + 1, attn, c10::nullopt, false, hidden);
    const torch::Tensor gate_up = matmul(i + 2, hidden, norms_[2 * l + 1], false, c10::nullopt);
    hidden = matmul(i + 3, gate_up, c10::nullopt, true, hidden);
  }
  return hidden;
}
