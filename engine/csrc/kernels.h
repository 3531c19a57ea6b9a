// The C++ CPU kernels of the engine, bound into one extension module (bindings.cpp).
#pragma once
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <memory>
#include <utility>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CBSERVE_BYTE_PRODUCTS 1  // the decode kernel multiplies 4- and 5-bit weights as bytes (vpdpbusd)
#endif

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

// paged_decode.cpp: one query token per request attends over its KV blocks (fp32 or fp16) in place,
// the last `window` keys of its context (0: all of them), its scores soft-capped (0: not).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap);

// paged_decode.cpp: paged_decode_attention's work, for callers that split it among threads
// themselves (the decode stack): one step's shape (the same in every layer), its (chunk, kv head)
// items, attend(items [begin, end) of q (B, H, D) against a layer's cache, into `partial`), then
// merge(rows [begin, end) of out (B, H, D): each query head's chunks combined) once all items are done.
struct DecodeAttention {
  DecodeAttention(int64_t num_heads, const torch::Tensor& layer_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, double scale, int64_t window, double softcap);
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
  // Request b's first key: its window's (window 0: its context's first).
  int64_t first_key(int64_t b) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
  void attend(const float* q, const void* layer_cache, int64_t begin, int64_t end) const;
  // Asks for the keys and values of items [begin, end) into L2, for a later attend.
  void prefetch(const void* layer_cache, int64_t begin, int64_t end) const;
  void merge(float* out, int64_t begin, int64_t end) const;

  int64_t B, H, KVH, NB, BS, D, max_blocks, window;
  bool half;
  float scale, softcap;
  const int64_t* tables;
  const int64_t* lens;
  std::vector<int64_t> first_chunk;  // request b's first chunk among all requests' chunks
  std::vector<int64_t> work_before;  // per item, the work of the items before it (tokens + kItemWork)
  Scratch<float> partial;
};

// y = RMSNorm(x) * w over n values (in place allowed): the kernels' RMSNorm, one home for its arithmetic.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  float squares = 0.f;
  for (int64_t k = 0; k < n; ++k) squares += x[k] * x[k];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = x[k] * inv * w[k];
}

// The gated prologues act(gate) * up of a fused gate/up output: none, SwiGLU, GeGLU (tanh), GeGLU (erf).
constexpr int64_t kGatedNone = 0, kGatedSilu = 1, kGatedGeluTanh = 2, kGatedGelu = 3;

// The decode kernel's weight formats (engine/models/gguf_types.py KERNEL_FORMATS): GGUF Q8_0 (0) and Q4_1
// (1) regrouped, Q8_0 times activations rounded to bf16 (2, the `int8` mode's), and the types read as the
// file stores them (gguf_rows.cpp).
constexpr int64_t kFormatQ8_0 = 0, kFormatQ4_1 = 1, kFormatQ8_0Bf16 = 2, kFormatQ4_0 = 3, kFormatQ5_0 = 4,
                  kFormatQ5_1 = 5, kFormatQ4_K = 6, kFormatQ5_K = 7, kFormatQ6_K = 8, kFormatIQ4_XS = 9;
// block_quant_linear.cpp: the bytes of a row of K weights in `format`, and the weights of a row of `bytes`.
int64_t format_row_bytes(int64_t format, int64_t K);
int64_t format_row_columns(int64_t format, int64_t bytes);

// A matmul's block-quantized weights: one or more parts stacked by rows (a fused q/k/v or gate/up whose
// parts a file stores in different types), each part's rows (N_p, row bytes) uint8 in its own format.
struct WeightRows {
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> formats;
  std::vector<int64_t> first;  // part p's first output row; first.back() is N
  int64_t K = 0;
  int64_t N() const { return first.back(); }
  bool has(int64_t format) const;
};
// block_quant_linear.cpp: the parts checked (known formats, each row K weights; bf16 activations alone) and stacked.
WeightRows weight_rows(std::vector<torch::Tensor> parts, std::vector<int64_t> formats);

// block_quant_linear.cpp: residual + prologue(x) times the weights (N, K) + bias, x quantized per block of 32
// inside (or, format 2, rounded to bf16). The prologue is RMSNorm with norm_weight, a gated activation
// (kGated*), or none.
torch::Tensor block_quant_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                                 const std::vector<int64_t>& formats, const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                                 const c10::optional<torch::Tensor>& residual);

// block_quant_linear.cpp: prologue(x) (M, K) as the kernels' products see it: rounded per block of
// 32 (q * d), or with bf16 rounded to bf16; for the fp32 GEMM path of larger batches, which so
// multiplies exactly the values the kernels and tiles multiply.
torch::Tensor kernel_activations(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight, double eps,
                                 int64_t gated, bool bf16);

// block_quant_linear.cpp: the rows a matmul multiplies with a fused prologue: RMSNorm(x) * norm_weight
// (x (M, K)), or act(x[:, :K]) * x[:, K:] (x (M, 2K), act by its kGated code); check_prologue checks x and the
// weight for K; with_prologue returns x's rows as they are without one, else the prologue's, kept
// in `transformed`.
void check_prologue(const torch::Tensor& x, int64_t K, const c10::optional<torch::Tensor>& norm_weight, int64_t gated);
// block_quant_linear.cpp: checks an (M, N) matmul's epilogue operands: bias fp32 (N), residual
// contiguous fp32 (M, N).
void check_bias_residual(const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual,
                         int64_t M, int64_t N);
const float* with_prologue(const torch::Tensor& x, int64_t M, int64_t K, const c10::optional<torch::Tensor>& norm_weight,
                           double eps, int64_t gated, Scratch<float>& transformed);
// with_prologue on raw rows: x's rows as they are without a prologue (no norm_weight, no gated activation),
// else the prologue's, kept in `transformed`.
const float* rows_after_prologue(const float* x, int64_t M, int64_t K, const float* norm_weight, double eps,
                                 int64_t gated, Scratch<float>& transformed);

// lora.cpp: one matmul of a LoRA adapter (engine/lora.py LoraMatmul): a (R, K), the parts' A stacked; per
// segment (j0, r, n0, n) its scaled B^T (r, n), adding A x's columns j0 .. j0 + r times it to output columns
// n0 .. n0 + n; fp32 or bf16 (`bf16`), x and the sums fp32.
struct LoraMatmul {
  torch::Tensor a;
  std::vector<torch::Tensor> b;
  std::vector<std::array<int64_t, 4>> segments;
  bool bf16 = false;
  int64_t rank() const { return a.size(0); }
};
// lora.cpp: rows' adapters' deltas for one matmul, in two phases a caller may split among threads:
// lora_shrink, items [begin, end) of T * width (row t, column j < its rank) of u = A x (u (T, width));
// then lora_expand, columns [c0, c1) of y (T, N) += u's segments times B^T. rows[t]: row t's adapter
// matmul, or nullptr; width: lora_width(rows).
int64_t lora_width(const std::vector<const LoraMatmul*>& rows);
void lora_shrink(const std::vector<const LoraMatmul*>& rows, const float* x, int64_t K, float* u, int64_t width,
                 int64_t begin, int64_t end);
void lora_expand(const std::vector<const LoraMatmul*>& rows, const float* u, int64_t width, float* y, int64_t N,
                 int64_t c0, int64_t c1);

// lora.cpp: the LoRA adapters a model holds, by slot, per layer and matmul (qkv, o, gate_up, down).
class LoraSlots {
 public:
  explicit LoraSlots(int64_t num_layers) : num_layers_(num_layers) {}
  // Matmul `which` of `layer` of the adapter in `slot`: a (R, K), b per segment (r, n), segments (S, 4)
  // int64 (j0, r, n0, n), all fp32 or all bf16; N and K: the matmul's (checked against them).
  void set(int64_t slot, int64_t layer, int64_t which, torch::Tensor a, std::vector<torch::Tensor> b,
           torch::Tensor segments, int64_t N);
  void clear(int64_t slot);
  // Per token, its adapter's matmul `which` of `layer` (nullptr for none); slots (T) int64, -1 for none.
  std::vector<const LoraMatmul*> rows(int64_t layer, int64_t which, const int64_t* slots, int64_t T) const;
  // Checks slots (T) int64: each an installed adapter's slot or -1.
  void check_slots(const torch::Tensor& slots) const;
  // y (T, N) += each row's adapter's delta for matmul `which` of `layer`; x (T, K) after its prologue.
  void add(int64_t layer, int64_t which, const torch::Tensor& x, const torch::Tensor& y,
           const torch::Tensor& slots) const;

 private:
  int64_t num_layers_;
  std::vector<std::vector<LoraMatmul>> slots_;  // [slot][layer * 4 + which]; a missing matmul's `a` undefined
};

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
                               const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                               const c10::optional<torch::Tensor>& residual, bool bf16_activations);

// block_quant_gemm.cpp: residual + prologue(x) (M, K) rounded to bf16 (the prologue as
// block_quant_linear's) times bf16 weights in AMX tile order + bias, for Q8_0 blocks whose scales have
// at most 8 significant bits: each weight d * q (15 bits) held exactly as two bf16 values, hi and lo,
// (N / 16, K / 32, 2 * 512): per block, hi's tile then lo's. The products are exact and summed in
// fp32 over all of K in the tiles: block_quant_linear's format 2 to fp32 rounding.
torch::Tensor bf16_tile_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const c10::optional<torch::Tensor>& bias,
                             const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                             const c10::optional<torch::Tensor>& residual);

// block_quant_linear.cpp: checks the large-batch GEMMs' per-block weight scales and (Q4_1) offsets,
// fp32 (K / 32, N); bf16 activations take Q8_0 blocks, without offsets.
void check_block_scales(const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets, int64_t nb, int64_t N,
                        bool bf16_activations);

// gguf_rows.cpp: row `row` of a part in `format` (its blocks as block_quant_linear reads them: Q8_0
// and Q4_1 regrouped, the rest as stored) as block integers, engine/models/gguf_types.py
// block_integers: q[nb * 32] (Q6_K's sub-scales folded in), d[nb] and m[nb] (0 without an offset),
// w = d * q + m computed as gguf computes it.
void unpack_row(int64_t format, const uint8_t* row, int64_t nb, int16_t* q, float* d, float* m);

// vector_gemm.cpp: block_quant_gemm's products for CPUs without AMX tiles, on the vector units
// (AVX512-VNNI, AVX-512, AVX2, or a plain loop, by the build's CPU features): residual + prologue(x)
// (M, K) times the weights block_quant_linear reads (parts' rows and formats, WeightRows), + bias:
// each pass's columns unpacked from their rows into integer tiles (int8 q, int16 for Q6_K; x
// quantized per block of 32 inside) or bf16 q (format 2: x rounded to bf16; AVX512-BF16), with
// scales d and offsets m, w = d * q (+ m). The weights are never held in another layout.
torch::Tensor vector_gemm(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const std::vector<int64_t>& formats, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
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
// as the kernel reads it; then rows [n0, n1) of out (M, N) = residual + x times the weights + bias,
// residual and bias optional (nullptr), residual possibly out itself.
struct LinearInput {
  int64_t M, K;
  Scratch<float> transformed;  // the prologue's rows, if any
  QuantizedX qx;
  Scratch<int8_t> xb;  // qx in byte order (for Q4_1 and stored_byte_form formats, AVX512-VNNI builds)
  Scratch<float> xr;   // rounded to bf16 (format 2)
};
LinearInput linear_input(const float* x, int64_t M, int64_t K, const float* norm_weight, double eps, int64_t gated,
                         const WeightRows& w);
void linear_rows(const LinearInput& in, const WeightRows& w, const float* bias, const float* residual, float* out,
                 int64_t n0, int64_t n1);

// gguf_rows.cpp: the formats read as stored (3-9): a row's bytes, its weights, and rows m0 .. m0 + mb of
// x (quantized; xb: the same in byte order where stored_byte_form asked for it, else nullptr) times one
// weight row of nb blocks of 32.
int64_t stored_row_bytes(int64_t format, int64_t K);
int64_t stored_row_columns(int64_t format, int64_t row_bytes);
void stored_dot_pass(const uint8_t* row, int64_t format, int64_t nb, const QuantizedX& qx, const int8_t* xb,
                     int64_t m0, int64_t mb, float* sums);

#if defined(CBSERVE_BYTE_PRODUCTS)
// gguf_rows.cpp: whether a stored format's rows multiply x in byte order (Q4_0, Q5_0, Q5_1, Q4_K,
// Q5_K: each weight an unsigned integer below 32, one scale and offset per block of 32).
bool stored_byte_form(int64_t format);

constexpr int64_t kQuadBytes = 4 * 64;  // a group of four blocks' activation bytes in byte order

// Four blocks' weight bytes (unsigned, below 32: lo holds each block's weights 0-15 in its 128-bit
// lane, hi weights 16-31) times a group's activation bytes: sixteen fp32 lanes, four per block (lane
// j / 4 is block j / 4), summing to the blocks' exact integer dot products (|sums| < 2^22).
__attribute__((always_inline)) inline __m512 quad_dot(__m512i lo, __m512i hi, const int8_t* x) {
  const __m512i* v = reinterpret_cast<const __m512i*>(x);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(v)), hi, _mm512_loadu_si512(v + 1));
  const __m512i l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(v + 2)), hi,
                                        _mm512_loadu_si512(v + 3));
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
}
#endif

// rope_kv.cpp: RoPE on qkv's q heads (and k heads), each head first RMS-normed by q_norm / k_norm
// (head_dim) where given, k and v written to the slots of a layer's cache (2, kv_heads, blocks,
// block_size, head_dim), fp32 or fp16: returns q (T, heads, head_dim), or with with_keys q and k
// (T, heads + kv_heads, head_dim), as decoder.py's _rope computes them.
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                            bool with_keys, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps);
// rope_write_kv's checks, then its work (q heads only) for a layer of kv_cache (layers, 2, kv_heads,
// blocks, block_size, head_dim) into q (T, heads, head_dim), unchecked, for items [begin, end) of
// the T * (heads + kv_heads) (token, q or k head): for the decode stack, which checks once per
// step, may not throw inside its thread team, and shares the items out.
void check_rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads);
void rope_write_kv_into(const float* qkv, const float* cos, const float* sin, const int64_t* slot, int64_t num_heads,
                        const torch::Tensor& kv_cache, int64_t layer, const float* q_norm, const float* k_norm,
                        float eps, float* q, int64_t begin, int64_t end);
// The cache lines rope_write_kv will write for these slots, asked for (to write) ahead: a step's
// slots were last touched long ago, and the stores' misses otherwise hold up the attention after.
// kv_cache: (layers, 2, kv_heads, blocks, block_size, head_dim).
void prefetch_kv_slots(const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slot_mapping);

// decode_stack.cpp: one block-quantized matmul of a decode stack: block_quant_linear's weights and
// bias, and whether the vector GEMM takes it past kernel_rows tokens.
struct StackMatmul {
  WeightRows weights;
  c10::optional<torch::Tensor> bias;
  bool vectored = false;
};

// decode_stack.cpp: a decode step (one token per request) through a stack of block-quantized
// decoder layers of any shape engine/models/decoder.py's layers take: per layer RMSNorm + qkv,
// optional q/k norms, RoPE (the layer's table) with k and v written to its cache slot, paged
// attention over its KV group's block tables (within the group's window; scores scaled, and
// soft-capped where softcap > 0), o (+ an optional post-attention norm) + residual, RMSNorm +
// gate/up, the gated activation + down (+ an optional post-MLP norm) + residual; or in place of
// the gated MLP a mixture of experts (add_experts): fp32 routing, top-k, each routed expert's two
// matmuls over its tokens, an optional shared expert with its sigmoid gate. Vectored matmuls run
// the vector GEMM on steps of more than kernel_rows tokens, block_quant_linear on the rest;
// layers with experts take steps of up to kernel_rows tokens only.
class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap,
              std::vector<int64_t> windows, int64_t kernel_rows);
  // Appends a layer. matmuls (each its parts' rows and formats, WeightRows): qkv, o, and gate_up, down
  // (or only qkv and o where add_experts follows); norms: input, mlp, post-attention, post-MLP, q, k (the
  // last four may be None); gated: kGated code; slot: its cache tensor; group: its KV group (windows'
  // index); rope: its table in forward's cos and sin.
  void add_layer(std::vector<std::vector<torch::Tensor>> rows, std::vector<std::vector<int64_t>> formats,
                 std::vector<c10::optional<torch::Tensor>> biases, std::vector<c10::optional<torch::Tensor>> norms,
                 int64_t gated, int64_t slot, int64_t group, int64_t rope);
  // Makes the last layer's MLP a mixture of experts: router (E, hidden) fp32; per expert its gate_up
  // then down (parts' rows, formats: 2E each, no tiles); shared: gate_up and down (or empty) with
  // shared_gate (1, hidden) fp32.
  void add_experts(torch::Tensor router, std::vector<std::vector<torch::Tensor>> rows,
                   std::vector<std::vector<int64_t>> formats, int64_t top_k, bool renormalize,
                   std::vector<std::vector<torch::Tensor>> shared_rows, std::vector<std::vector<int64_t>> shared_formats,
                   c10::optional<torch::Tensor> shared_gate);
  // Runs matmul `which` (0-3) of layer `layer` on the vector GEMM past kernel_rows tokens.
  void use_vector_gemm(int64_t layer, int64_t which);
  // The LoRA adapters forward's lora_slots name (held: the model installs adapters into them).
  void use_lora(std::shared_ptr<LoraSlots> loras) { loras_ = std::move(loras); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // hidden (T, hidden) through the first num_layers layers; cos/sin (tables, T, head_dim) at the
  // tokens' positions (sin's first half negated); kv_cache (slots, 2, kv_heads, blocks, block_size,
  // head_dim), fp32 or fp16; per KV group the slots (T) it writes and its block tables (T, max
  // blocks); seq_lens (T) as for paged_decode_attention; lora_slots (T) int64: each token's adapter's
  // slot, -1 for none (None: no adapters).
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& kv_cache, const std::vector<torch::Tensor>& slot_mappings,
                        const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                        int64_t num_layers, const c10::optional<torch::Tensor>& lora_slots) const;

 private:
  struct Experts {
    torch::Tensor router;  // (E, hidden) fp32
    std::vector<StackMatmul> matmuls;  // per expert: gate_up, down
    int64_t top_k;
    bool renormalize;
    std::vector<StackMatmul> shared;  // gate_up, down, or empty
    c10::optional<torch::Tensor> shared_gate;  // (1, hidden) fp32
  };
  struct Layer {
    StackMatmul matmuls[4];  // qkv, o, gate_up, down
    bool gated_mlp = false;  // gate_up and down are its MLP (else experts, added after it)
    torch::Tensor input_norm, mlp_norm;
    c10::optional<torch::Tensor> post_attention_norm, post_mlp_norm, q_norm, k_norm;
    int64_t gated, slot, group, rope;
    std::unique_ptr<Experts> experts;
  };
  // matmul m of x, its prologue and residual fused (the vector GEMM past kernel_rows rows where m is vectored).
  torch::Tensor matmul(const StackMatmul& m, const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight,
                       int64_t gated, const c10::optional<torch::Tensor>& residual) const;
  // forward when every matmul runs block_quant_linear's kernel: one thread team for the whole step,
  // each op's rows shared out and a barrier between ops, no tensor made or thread woken per op.
  torch::Tensor forward_team(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& kv_cache, const std::vector<torch::Tensor>& slot_mappings,
                             const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                             int64_t num_layers, const std::vector<std::vector<const LoraMatmul*>>& loras) const;
  // Per layer and matmul (l * 4 + which), each token's adapter's LoraMatmul or nullptr; empty without adapters.
  std::vector<std::vector<const LoraMatmul*>> lora_rows(const c10::optional<torch::Tensor>& lora_slots,
                                                        int64_t num_layers) const;
  std::shared_ptr<LoraSlots> loras_;
  StackMatmul stack_matmul(std::vector<torch::Tensor> parts, std::vector<int64_t> formats,
                           c10::optional<torch::Tensor> bias) const;

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
  std::vector<int64_t> windows_;
  int64_t kernel_rows_;
  std::vector<Layer> layers_;
};
