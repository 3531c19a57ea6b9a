// Matmul on GGUF block-quantized weights for decode-sized batches. As in llama.cpp, each row of x
// is quantized per block of 32 and every block's dot product is an integer sum scaled once; but to
// 15 bits (d = max |x| / 16256), not llama.cpp's 8: int8 activations cost SmolLM2-135M 3% of
// top-1 agreement with fp32, 15 bits nothing measurable. q = 128 * hi + lo with hi in [-127, 127]
// and lo in [0, 127], two int8 halves, so each block takes two byte dot products (maddubs). A decode step is bound by the bytes of weights it reads: Q4_1
// reads 5 bits per weight, Q8_0 8.5, fp32 32; the integer dots (maddubs) keep the arithmetic
// below the memory time. torch has no kernel for these formats on CPU: its int8 paths want
// AVX-512 VNNI (fbgemm, oneDNN) or bf16 activations, and quantize activations per tensor.
//
// Formats, one block of 32 weights as stored in a GGUF file (little-endian, unaligned):
//   Q8_0: fp16 d, int8 q[32]              w = d * q
//   Q4_1: fp16 d, fp16 m, uint8 nibbles[16] w = d * q + m; weight i < 16 is the low nibble of
//         byte i, weight i >= 16 the high nibble of byte i - 16
#include "kernels.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int32_t kLevels = 127 * 128;  // activations in [-kLevels, kLevels] * d (engine/models/linear.py)
constexpr int64_t kRowsPerPass = 4;  // rows of x sharing one read of a weight block
enum Format : int64_t { kQ8_0 = 0, kQ4_1 = 1 };

inline int64_t block_bytes(int64_t format) { return format == kQ8_0 ? 34 : 20; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// x's rows quantized per block: q = 128 * hi + lo (M, K), d (M, K / 32) scales, s (M, K / 32) =
// d * sum(q), which Q4_1's offset m multiplies. The same IEEE arithmetic as engine/models/linear.py's
// quantize_activations, so the GEMM path sees the same values: compiled without -ffast-math,
// which would fold 1 / (amax / 127) into 127 / amax and round some ties the other way.
struct QuantizedX {
  std::vector<int8_t> hi, lo;
  std::vector<float> d, s;
};

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K), std::vector<float>(M * nb),
                 std::vector<float>(M * nb)};
  for (int64_t b = 0; b < M * nb; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / static_cast<float>(kLevels), id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      out.hi[b * kBlock + i] = static_cast<int8_t>(v >> 7);  // floor(v / 128)
      out.lo[b * kBlock + i] = static_cast<int8_t>(v & 127);
      sum += v;
    }
    out.d[b] = d;
    out.s[b] = d * static_cast<float>(sum);
  }
  return out;
}
#pragma GCC pop_options

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// acc[i] += weight block blk . block b of row m0 + i of x (scaled), for i < MB.
template <int64_t Format, int64_t MB>
__attribute__((always_inline)) inline void block_step(const uint8_t* blk, int64_t b, int64_t nb, const QuantizedX& qx,
                                                      int64_t m0, __m256* acc, float* offsets) {
  const float dw = half_at(blk), mw = Format == kQ4_1 ? half_at(blk + 2) : 0.f;  // scale, Q4_1 offset
  __m256i wq;  // Q8_0: the signed weights; Q4_1: the nibbles as bytes 0-15
  if constexpr (Format == kQ8_0) {
    wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
  }
  // maddubs multiplies unsigned by signed bytes: Q8_0 passes |w| and moves w's sign onto x
  const __m256i wu = Format == kQ8_0 ? _mm256_sign_epi8(wq, wq) : wq;
  for (int64_t i = 0; i < MB; ++i) {
    const int64_t xb = (m0 + i) * nb + b;
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.hi.data() + xb * kBlock));
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.lo.data() + xb * kBlock));
    if constexpr (Format == kQ8_0) {
      hi = _mm256_sign_epi8(hi, wq);
      lo = _mm256_sign_epi8(lo, wq);
    }
    const __m256i dot_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, hi), _mm256_set1_epi16(128));
    const __m256i dot_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, lo), _mm256_set1_epi16(1));
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(dot_hi, dot_lo));
    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * qx.d[xb]), dot, acc[i]);
    if constexpr (Format == kQ4_1) offsets[i] += mw * qx.s[xb];
  }
}
#endif

// sums[i] = row n of the weight (its nb blocks at w) . row m0 + i of x, for i < MB. Each weight
// block is decoded once for the MB rows; Format and MB are template arguments so the block
// layout is fixed and the accumulators stay in registers.
template <int64_t Format, int64_t MB>
inline void dot_rows(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t m0, float* sums) {
  constexpr int64_t bytes = Format == kQ8_0 ? 34 : 20;
  float offsets[MB] = {};  // Q4_1: sum over blocks of m * d_x * sum(q_x)
#if defined(__AVX2__) && defined(__FMA__)
  __m256 even[MB], odd[MB];  // two FMA chains per row hide the FMA latency
  for (int64_t i = 0; i < MB; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    block_step<Format, MB>(w + b * bytes, b, nb, qx, m0, even, offsets);
    block_step<Format, MB>(w + (b + 1) * bytes, b + 1, nb, qx, m0, odd, offsets);
  }
  if (b < nb) block_step<Format, MB>(w + b * bytes, b, nb, qx, m0, even, offsets);
  for (int64_t i = 0; i < MB; ++i) sums[i] = hsum(_mm256_add_ps(even[i], odd[i])) + offsets[i];
#else
  float acc[MB] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const float dw = half_at(blk), mw = Format == kQ4_1 ? half_at(blk + 2) : 0.f;
    for (int64_t i = 0; i < MB; ++i) {
      const int64_t xb = (m0 + i) * nb + b;
      const int8_t* hi = qx.hi.data() + xb * kBlock;
      const int8_t* lo = qx.lo.data() + xb * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t wj = Format == kQ8_0 ? static_cast<int8_t>(blk[2 + j])
                                           : (j < 16 ? blk[4 + j] & 0x0f : blk[4 + j - 16] >> 4);
        dot += wj * (128 * hi[j] + lo[j]);
      }
      acc[i] += dw * qx.d[xb] * static_cast<float>(dot);
      if constexpr (Format == kQ4_1) offsets[i] += mw * qx.s[xb];
    }
  }
  for (int64_t i = 0; i < MB; ++i) sums[i] = acc[i] + offsets[i];
#endif
}

template <int64_t Format>
inline void dot_pass(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t m0, int64_t mb, float* sums) {
  switch (mb) {
    case 1: dot_rows<Format, 1>(w, nb, qx, m0, sums); break;
    case 2: dot_rows<Format, 2>(w, nb, qx, m0, sums); break;
    case 3: dot_rows<Format, 3>(w, nb, qx, m0, sums); break;
    default: dot_rows<Format, 4>(w, nb, qx, m0, sums); break;
  }
}

// The rows the matmul multiplies, when a prologue is fused: RMSNorm(x) * norm_weight, or SwiGLU
// silu(x[:, :K]) * x[:, K:] (x twice as wide as the weight).
std::vector<float> prologue(const float* x, int64_t M, int64_t K, const float* norm_weight, float eps, bool swiglu) {
  std::vector<float> rows(M * K);
  for (int64_t m = 0; m < M; ++m) {
    float* y = rows.data() + m * K;
    if (swiglu) {
      const float* gate = x + m * 2 * K;
      for (int64_t k = 0; k < K; ++k) y[k] = gate[k] / (1.f + std::exp(-gate[k])) * gate[K + k];
    } else {
      const float* xr = x + m * K;
      float squares = 0.f;
      for (int64_t k = 0; k < K; ++k) squares += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(K) + eps);
      for (int64_t k = 0; k < K; ++k) y[k] = xr[k] * inv * norm_weight[k];
    }
  }
  return rows;
}

}  // namespace

torch::Tensor block_quant_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t format,
                                 const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& norm_weight, double eps, bool swiglu,
                                 const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(format == kQ8_0 || format == kQ4_1, "format: 0 (Q8_0) or 1 (Q4_1)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % block_bytes(format) == 0, "blocks: contiguous uint8 (N, K / 32 * block bytes)");
  const int64_t N = blocks.size(0), nb = blocks.size(1) / block_bytes(format), K = nb * kBlock, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) == (swiglu ? 2 * K : K), "x: contiguous fp32 (M, K), (M, 2K) with swiglu");
  TORCH_CHECK(!(swiglu && norm_weight.has_value()), "one prologue: norm or swiglu");
  TORCH_CHECK(!norm_weight.has_value() || (norm_weight->scalar_type() == torch::kFloat &&
                  norm_weight->is_contiguous() && norm_weight->numel() == K), "norm_weight: fp32 (K)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->numel() == N), "bias: fp32 (N)");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == torch::kFloat && residual->is_contiguous() &&
                  residual->size(0) == M && residual->size(1) == N), "residual: contiguous fp32 (M, N)");
  const float* rows = x.data_ptr<float>();
  std::vector<float> transformed;
  if (swiglu || norm_weight.has_value()) {
    transformed = prologue(rows, M, K, norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr,
                           static_cast<float>(eps), swiglu);
    rows = transformed.data();
  }
  const QuantizedX qx = quantize_x(rows, M, K);
  auto out = torch::empty({M, N}, x.options());
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float sums[kRowsPerPass];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
        const int64_t mb = std::min(kRowsPerPass, M - m0);
        if (format == kQ8_0) {
          dot_pass<kQ8_0>(wp + n * row_bytes, nb, qx, m0, mb, sums);
        } else {
          dot_pass<kQ4_1>(wp + n * row_bytes, nb, qx, m0, mb, sums);
        }
        for (int64_t i = 0; i < mb; ++i) {
          const int64_t at = (m0 + i) * N + n;
          op[at] = (rp ? rp[at] : 0.f) + (sums[i] + (bp ? bp[n] : 0.f));
        }
      }
    }
  });
  return out;
}
