// RoPE on a step's q and k heads, with k and v written to their paged cache slots, in one pass
// over the qkv matmul's output: engine/models/decoder.py's _rope and the torch backend's KV write
// (a roll, a multiply, an addcmul, a stack and an index_copy per layer) rounded alike, bit for bit;
// q/k norms (Qwen3, Gemma 3) before it where given, in the kernels' RMSNorm arithmetic.
// The decode stack and, on CPU, the layers' own path both call it.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <immintrin.h>
#include <vector>

namespace {

// out = x * cos + roll(x, D / 2) * sin rounded as torch rounds llama.py's mul and addcmul (the
// product x * cos, then one fused multiply-add), so q and k are bit for bit _rope's.
// The two halves in separate loops (no index modulo), so the compiler vectorises them.
__attribute__((optimize("no-fast-math", "fp-contract=off"))) void rope(const float* x, const float* cos,
                                                                         const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = std::fma(x[i + half], sin[i], x[i] * cos[i]);
  for (int64_t i = half; i < D; ++i) out[i] = std::fma(x[i - half], sin[i], x[i] * cos[i]);
}

// x's D floats into a cache row of fp32 or fp16 (rounded to nearest even, as torch's conversion).
void store(const float* x, int64_t D, float* out) { std::copy(x, x + D, out); }

void store(const float* x, int64_t D, at::Half* out) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= D; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= D; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < D; ++i) out[i] = static_cast<at::Half>(x[i]);
}

// Items [begin, end) of (token, q or k head): each token's q heads after RoPE into out (out_heads
// per token: H, or H + KVH with its k heads after RoPE too), its k heads after RoPE and their v
// heads into their cache slots; each q and k head RMS-normed first by q_norm / k_norm where given.
template <typename Element>
void rope_items(const float* qkv, const float* cos, const float* sin, const int64_t* slot, int64_t H, int64_t KVH,
                int64_t D, int64_t slots, const float* q_norm, const float* k_norm, float eps, float* out,
                int64_t out_heads, Element* keys, int64_t begin, int64_t end) {
  const int64_t QK = H + KVH;
  Element* values = keys + KVH * slots * D;
  std::vector<float> scratch(D), normed(D);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / QK, head = item % QK;
    const float* x = qkv + (t * (QK + KVH) + head) * D;
    const float* norm = head < H ? q_norm : k_norm;
    if (norm != nullptr) {
      rms_norm_row(x, norm, D, eps, normed.data());
      x = normed.data();
    }
    float* rotated = head < out_heads ? out + (t * out_heads + head) * D : scratch.data();
    rope(x, cos + t * D, sin + t * D, D, rotated);
    if (head < H) continue;
    store(rotated, D, keys + ((head - H) * slots + slot[t]) * D);
    store(qkv + (t * (QK + KVH) + QK + head - H) * D, D, values + ((head - H) * slots + slot[t]) * D);  // its v
  }
}

// rope_items on a cache of either element type, from its element `first` (a layer's start).
void rope_items_in(const torch::Tensor& cache, int64_t first, const float* qkv, const float* cos, const float* sin,
                   const int64_t* slot, int64_t H, int64_t KVH, int64_t D, int64_t slots, const float* q_norm,
                   const float* k_norm, float eps, float* out, int64_t out_heads, int64_t begin, int64_t end) {
  if (cache.scalar_type() == torch::kHalf)
    rope_items(qkv, cos, sin, slot, H, KVH, D, slots, q_norm, k_norm, eps, out, out_heads,
               cache.data_ptr<at::Half>() + first, begin, end);
  else
    rope_items(qkv, cos, sin, slot, H, KVH, D, slots, q_norm, k_norm, eps, out, out_heads,
               cache.data_ptr<float>() + first, begin, end);
}

}  // namespace

void check_rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads) {
  const int64_t T = qkv.size(0), H = num_heads;
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(0) == 2 && layer_cache.is_contiguous(),
              "layer_cache: contiguous (2, kv_heads, blocks, block_size, head_dim)");
  TORCH_CHECK(layer_cache.scalar_type() == torch::kFloat || layer_cache.scalar_type() == torch::kHalf,
              "layer_cache: fp32 or fp16");
  const int64_t KVH = layer_cache.size(1), D = layer_cache.size(4), slots = layer_cache.size(2) * layer_cache.size(3);
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && qkv.dim() == 2 && qkv.is_contiguous() &&
                  qkv.size(1) == (H + 2 * KVH) * D, "qkv: contiguous fp32 (T, (heads + 2 kv_heads) * head_dim)");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.sizes() == sin.sizes() &&
                  cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous(),
              "cos, sin: contiguous fp32 (T, head_dim)");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == T && slot_mapping.is_contiguous(),
              "slot_mapping: int64 (T)");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot out of the cache");
}

void rope_write_kv_into(const float* qkv, const float* cos, const float* sin, const int64_t* slot, int64_t num_heads,
                        const torch::Tensor& kv_cache, int64_t layer, const float* q_norm, const float* k_norm,
                        float eps, float* q, int64_t begin, int64_t end) {
  const int64_t KVH = kv_cache.size(2), slots = kv_cache.size(3) * kv_cache.size(4), D = kv_cache.size(5);
  rope_items_in(kv_cache, layer * 2 * KVH * slots * D, qkv, cos, sin, slot, num_heads, KVH, D, slots, q_norm, k_norm,
                eps, q, num_heads, begin, end);
}

torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& layer_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                            bool with_keys, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps) {
  check_rope_write_kv(qkv, cos, sin, layer_cache, slot_mapping, num_heads);
  const int64_t T = qkv.size(0), H = num_heads, KVH = layer_cache.size(1), D = layer_cache.size(4);
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!norm->has_value() || ((*norm)->scalar_type() == torch::kFloat && (*norm)->is_contiguous() &&
                                       (*norm)->numel() == D), "q_norm, k_norm: contiguous fp32 (head_dim)");
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const int64_t slots = layer_cache.size(2) * layer_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t out_heads = with_keys ? H + KVH : H;
  torch::Tensor out = torch::empty({T, out_heads, D}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * (H + KVH), 64, [&](int64_t begin, int64_t end) {
    rope_items_in(layer_cache, 0, x, c, sn, slot, H, KVH, D, slots, qn, kn, static_cast<float>(eps), op, out_heads,
                  begin, end);
  });
  return out;
}

void prefetch_kv_slots(const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slot_mapping) {
  const int64_t KVH = kv_cache.size(2), slots = kv_cache.size(3) * kv_cache.size(4);
  const int64_t row_bytes = kv_cache.size(5) * kv_cache.element_size();
  const char* base = static_cast<const char*>(kv_cache.data_ptr()) + layer * 2 * KVH * slots * row_bytes;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    for (int64_t row = 0; row < 2 * KVH; ++row)  // each kv head's k, then each one's v
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + (row * slots + slot[t]) * row_bytes + b, 1);
}
