// Weight-only int8 matmul for decode-sized batches: y[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / G]
// with fp32 activations and int8 weights, one scale per group of G consecutive weights of a row. A decode step is bound
// by the bytes of weights it reads; this reads each int8 row once for all M rows of x (M small),
// converting 8 weights at a time to fp32 for the FMAs. torch has no fast kernel for this
// combination on CPU (its weight-only kernels take bf16 activations; with fp32 they fall back
// to scalar loops).
#include "kernels.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerBlock = 4;

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// sums[i] = sum over groups g of scale[g] * (x[m0 + i] . w) over group g, for i < MB. MB is a
// template argument so the accumulators stay in registers; two weight vectors per iteration give
// each row two independent FMA chains.
template <int64_t MB>
inline void dot_rows(const float* x, const int8_t* w, const float* scale, int64_t K, int64_t G, int64_t m0,
                     float* sums) {
  for (int64_t i = 0; i < MB; ++i) sums[i] = 0.f;
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const float s = scale[g0 / G];
    int64_t k = g0;
    float part[MB];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0[MB], acc1[MB];
    for (int64_t i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    for (; k + 16 <= g0 + G; k += 16) {
      const __m128i w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w16));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w16, 8)));
      for (int64_t i = 0; i < MB; ++i) {
        const float* xr = x + (m0 + i) * K + k;
        acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[i]);
        acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[i]);
      }
    }
    for (int64_t i = 0; i < MB; ++i) part[i] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
#else
    for (int64_t i = 0; i < MB; ++i) part[i] = 0.f;
#endif
    for (; k < g0 + G; ++k)
      for (int64_t i = 0; i < MB; ++i) part[i] += static_cast<float>(w[k]) * x[(m0 + i) * K + k];
    for (int64_t i = 0; i < MB; ++i) sums[i] += s * part[i];
  }
}

inline void dot_block(const float* x, const int8_t* w, const float* scale, int64_t K, int64_t G, int64_t m0,
                      int64_t mb, float* sums) {
  switch (mb) {
    case 1: dot_rows<1>(x, w, scale, K, G, m0, sums); break;
    case 2: dot_rows<2>(x, w, scale, K, G, m0, sums); break;
    case 3: dot_rows<3>(x, w, scale, K, G, m0, sums); break;
    default: dot_rows<4>(x, w, scale, K, G, m0, sums); break;
  }
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kChar && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "weight: contiguous int8 (N, K)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == torch::kFloat && scale.is_contiguous() &&
                  scale.size(0) == N && K % scale.size(1) == 0, "scale: contiguous fp32 (N, K / group)");
  const int64_t G = K / scale.size(1), num_groups = scale.size(1);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float sums[kRowsPerBlock];
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = wp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerBlock) {
        const int64_t mb = std::min(kRowsPerBlock, M - m0);
        dot_block(xp, w, sp + n * num_groups, K, G, m0, mb, sums);
        for (int64_t i = 0; i < mb; ++i) op[(m0 + i) * N + n] = sums[i] + (bp ? bp[n] : 0.f);
      }
    }
  });
  return out;
}
