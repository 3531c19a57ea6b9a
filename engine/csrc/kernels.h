// The C++ CPU kernels of the engine, bound into one extension module (bindings.cpp).
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

// scratch.cpp: arrays for a kernel's intermediate values, from those the calling thread freed where
// one is large enough: malloc's arenas are shared once a process has more threads than it makes them.
struct ScratchFree {
  void operator()(void* data) const noexcept;
};
template <typename T>
using Scratch = std::unique_ptr<T[], ScratchFree>;
void* scratch_bytes(size_t bytes);
template <typename T>
Scratch<T> scratch(int64_t count) {
  return Scratch<T>(static_cast<T*>(scratch_bytes(sizeof(T) * static_cast<size_t>(count))));
}

// paged_decode.cpp: one query token per request attends over its KV blocks (fp32 or fp16) in place.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);

// paged_decode.cpp: paged_decode_attention's work, for callers that split it among threads
// themselves (the decode stack): one step's shape (the same in every layer), its (chunk, kv head)
// items, attend(items [begin, end) of q (B, H, D) against a layer's cache, into `partial`), then
// merge(rows [begin, end) of out (B, H, D): each query head's chunks combined) once all items are done.
struct DecodeAttention {
  DecodeAttention(int64_t num_heads, const torch::Tensor& layer_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, double scale);
  int64_t num_items() const;
  // The items thread `thread` of `threads` takes: even shares of the items' tokens (a request's last
  // chunk is short), where even shares of items left one thread a third of the other's work idle.
  std::pair<int64_t, int64_t> items_of(int64_t thread, int64_t threads) const;
  struct Item {  // request b's tokens [t0, t1), kv head h
    int64_t b, h, t0, t1;
    const int64_t* table;  // b's block table
  };
  Item item(int64_t index) const;
  int64_t stride() const { return D + 2; }  // per item and query head: max score, sum of exp, D of output
  void attend(const float* q, const void* layer_cache, int64_t begin, int64_t end) const;
  // Asks for the keys and values of items [begin, end) into L2, for a later attend.
  void prefetch(const void* layer_cache, int64_t begin, int64_t end) const;
  void merge(float* out, int64_t begin, int64_t end) const;

  int64_t B, H, KVH, NB, BS, D, max_blocks;
  bool half;
  float scale;
  const int64_t* tables;
  const int64_t* lens;
  std::vector<int64_t> first_chunk;  // request b's first chunk among all requests' chunks
  std::vector<int64_t> work_before;  // per item, the work of the items before it (tokens + kItemWork)
  Scratch<float> partial;
};

// block_quant_linear.cpp: residual + prologue(x) times GGUF Q8_0 (format 0) or Q4_1 (format 1) weight
// blocks (N, K / 32 * block bytes) + bias, x quantized per block of 32 inside; or Q8_0 blocks times x
// rounded to bf16 (format 2, kQ8_0Bf16). The prologue is RMSNorm with norm_weight, SwiGLU, or none.
torch::Tensor block_quant_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t format,
                                 const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                                 const c10::optional<torch::Tensor>& residual);

// block_quant_linear.cpp: prologue(x) (M, K) as the kernels' products see it: rounded per block of
// 32 (q * d), or with bf16 rounded to bf16; for the fp32 GEMM path of larger batches, which so
// multiplies exactly the values the kernels and tiles multiply.
torch::Tensor kernel_activations(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight, double eps,
                                 bool swiglu, bool bf16);

// block_quant_linear.cpp: the rows a matmul multiplies with a fused prologue: RMSNorm(x) * norm_weight
// (x (M, K)), or SwiGLU silu(x[:, :K]) * x[:, K:] (x (M, 2K)); check_prologue checks x and the
// weight for K; with_prologue returns x's rows as they are without one, else the prologue's, kept
// in `transformed`.
void check_prologue(const torch::Tensor& x, int64_t K, const c10::optional<torch::Tensor>& norm_weight, bool swiglu);
// block_quant_linear.cpp: checks an (M, N) matmul's epilogue operands: bias fp32 (N), residual
// contiguous fp32 (M, N).
void check_bias_residual(const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual,
                         int64_t M, int64_t N);
const float* with_prologue(const torch::Tensor& x, int64_t M, int64_t K, const c10::optional<torch::Tensor>& norm_weight,
                           double eps, bool swiglu, Scratch<float>& transformed);

// block_quant_gemm.cpp: whether this process may run block_quant_gemm (built with AMX, and the
// kernel grants the tile state).
bool block_quant_gemm_available();

// block_quant_gemm.cpp: residual + prologue(x) (M, K) (quantized per block of 32 inside, or with
// bf16_activations rounded to bf16; the prologue as block_quant_linear's) times block-quantized
// weights in AMX tile order + bias: the integer values q (N / 16, K / 32, 512) as bf16
// (block_quant_linear's formats as integers: Q8_0 -127..127, Q4_1 0..15), per-block scales d
// (K / 32, N) and, for Q4_1, offsets m (K / 32, N), w = d * q + m. The same dot product per block
// as block_quant_linear's (format 0 or 1; with bf16_activations, format 2), to fp32 rounding.
torch::Tensor block_quant_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales,
                               const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& bias,
                               const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                               const c10::optional<torch::Tensor>& residual, bool bf16_activations);

// block_quant_gemm.cpp: residual + prologue(x) (M, K) rounded to bf16 (the prologue as
// block_quant_linear's) times bf16 weights in AMX tile order + bias, for Q8_0 blocks whose scales have
// at most 8 significant bits: each weight d * q (15 bits) held exactly as two bf16 values, hi and lo,
// (N / 16, K / 32, 2 * 512): per block, hi's tile then lo's. The products are exact and summed in
// fp32 over all of K in the tiles: block_quant_linear's format 2 to fp32 rounding.
torch::Tensor bf16_tile_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const c10::optional<torch::Tensor>& bias,
                             const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                             const c10::optional<torch::Tensor>& residual);

// block_quant_linear.cpp: checks the large-batch GEMMs' per-block weight scales and (Q4_1) offsets,
// fp32 (K / 32, N); bf16 activations take Q8_0 blocks, without offsets.
void check_block_scales(const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets, int64_t nb, int64_t N,
                        bool bf16_activations);

// vector_gemm.cpp: block_quant_gemm's products for CPUs without AMX tiles, on the vector units
// (AVX512-VNNI, AVX-512, AVX2, or a plain loop, by the build's CPU features): residual + prologue(x)
// (M, K) times weights in tile order (N / 16, K / 32, 512): int8 q (integer formats, x quantized per
// block of 32 inside) or bf16 q (x rounded to bf16; AVX512-BF16), with scales d and (Q4_1)
// offsets m (K / 32, N), w = d * q (+ m), + bias.
torch::Tensor vector_gemm(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                          const c10::optional<torch::Tensor>& residual);
// The instructions vector_gemm's integer products were built for: avx512_vnni, avx512, avx2 or plain.
std::string vector_gemm_isa();
// Whether vector_gemm takes bf16 activations in this build.
bool vector_gemm_bf16();

// fp32 to bf16 bits, rounded to nearest even as torch's .bfloat16() rounds (activations are finite).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Activations quantized per block of 32 to 15 bits (block_quant_linear.cpp), for the matmul kernels:
// q (M, K) int16, d (M, nbp) scales, s (M, nbp) = d * sum(q), which Q4_1's offset m multiplies;
// nbp = K / 32 rounded up to whole groups of kQuantizedXGroup blocks, the padding zero. Allocated
// without clearing: quantize_x writes every element, and clearing MBs per call costs more than that.
constexpr int64_t kQuantizedXGroup = 4;
struct QuantizedX {
  int64_t nbp;
  Scratch<int16_t> q;
  Scratch<float> d, s;
};
QuantizedX quantize_x(const float* x, int64_t M, int64_t K);

// block_quant_linear.cpp: block_quant_linear in two parts, for callers that split the rows among
// threads themselves (the decode stack): x (M, K) after its prologue, quantized (or rounded to bf16)
// as the kernel reads it; then rows [n0, n1) of out (M, N) = residual + x times blocks (N, K / 32 *
// block bytes) + bias, residual and bias optional (nullptr), residual possibly out itself.
struct LinearInput {
  int64_t M, K;
  Scratch<float> transformed;  // the prologue's rows, if any
  QuantizedX qx;
  Scratch<int8_t> xb;  // qx in byte order (Q4_1 on AVX512-VNNI builds)
  Scratch<float> xr;   // rounded to bf16 (format 2)
};
// The columns K of blocks (N, K / 32 * block bytes) in format.
int64_t block_quant_columns(const torch::Tensor& blocks, int64_t format);
LinearInput linear_input(const float* x, int64_t M, int64_t K, const float* norm_weight, double eps, bool swiglu,
                         int64_t format);
void linear_rows(const LinearInput& in, const uint8_t* blocks, int64_t format, int64_t N, const float* bias,
                 const float* residual, float* out, int64_t n0, int64_t n1);

// rope_kv.cpp: RoPE on qkv's q heads (and k heads), k and v written to the slots of a layer's cache
// (2, kv_heads, blocks, block_size, head_dim), fp32 or fp16: returns q (T, heads, head_dim), or with
// with_keys q and k (T, heads + kv_heads, head_dim), as llama.py's _rope computes them.
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                            bool with_keys);
// rope_write_kv's checks, then its work (q heads only) for a layer of kv_cache (layers, 2, kv_heads,
// blocks, block_size, head_dim) into q (T, heads, head_dim), unchecked, for items [begin, end) of
// the T * (heads + kv_heads) (token, q or k head): for the decode stack, which checks once per
// step, may not throw inside its thread team, and shares the items out.
void check_rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads);
void rope_write_kv_into(const float* qkv, const float* cos, const float* sin, const int64_t* slot, int64_t num_heads,
                        const torch::Tensor& kv_cache, int64_t layer, float* q, int64_t begin, int64_t end);
// The cache lines rope_write_kv will write for these slots, asked for (to write) ahead: a step's
// slots were last touched long ago, and the stores' misses otherwise hold up the attention after.
// kv_cache: (layers, 2, kv_heads, blocks, block_size, head_dim).
void prefetch_kv_slots(const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slot_mapping);

// decode_stack.cpp: a decode step (one token per request) through a stack of block-quantized
// Llama layers, each layer's four matmuls (qkv, o, gate_up, down: block_quant_linear's rows,
// formats and biases) and two RMSNorm weights (input, post-attention) held from construction.
// Matmuls given vector_gemm's tiles, scales and offsets run it on steps of more than kernel_rows
// tokens (BlockQuantLinear's decode_rows), block_quant_linear on the rest.
class DecodeStack {
 public:
  static constexpr int64_t kMatmuls = 4;
  DecodeStack(std::vector<torch::Tensor> rows, std::vector<int64_t> formats,
              std::vector<c10::optional<torch::Tensor>> biases, std::vector<torch::Tensor> norms, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<c10::optional<torch::Tensor>> tiles,
              std::vector<c10::optional<torch::Tensor>> scales, std::vector<c10::optional<torch::Tensor>> offsets,
              int64_t kernel_rows);
  int64_t num_layers() const;
  // hidden (T, hidden) through the first num_layers layers; cos/sin (T, head_dim) at the tokens'
  // positions (sin's first half negated); kv_cache (layers, 2, kv_heads, blocks, block_size,
  // head_dim), fp32 or fp16, written at slot_mapping (T); block_tables (T, max blocks), seq_lens (T) and the
  // attention scale as for paged_decode_attention.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                        int64_t num_layers) const;

 private:
  // Matmul i (layer * kMatmuls + which) of x, its prologue and residual fused.
  torch::Tensor matmul(int64_t i, const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight, bool swiglu,
                       const c10::optional<torch::Tensor>& residual) const;
  // forward when every matmul runs block_quant_linear's kernel: one thread team for the whole step,
  // each op's rows shared out and a barrier between ops, no tensor made or thread woken per op.
  torch::Tensor forward_team(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                             int64_t num_layers) const;

  std::vector<torch::Tensor> rows_;
  std::vector<int64_t> formats_;
  std::vector<c10::optional<torch::Tensor>> biases_;
  std::vector<torch::Tensor> norms_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  std::vector<c10::optional<torch::Tensor>> tiles_, scales_, offsets_;
  int64_t kernel_rows_;
};
