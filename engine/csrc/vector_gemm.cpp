// Matmul on block-quantized weights for large batches (prefill chunks, decode batches past the
// decode kernel's rows) on CPUs without AMX tiles, on the vector units: the products of
// block_quant_linear (the decode kernel) and block_quant_gemm (the AMX tiles), register-blocked so
// each weight vector loaded serves several rows and each activation broadcast several columns.
//
// Integer formats (the GGUF types, engine/models/gguf_types.py block_integers): activations quantized
// per block of 32 to 15 bits (quantize_x), weights q as int8 (Q8_0 -127..127, Q4_1 0..15, ...) widened
// to 16 bits in registers, or as int16 (Q6_K, its sub-scales folded in: |q| <= 4064), each block's dot
// product summed exactly in int32 by 16-bit pair products: AVX512-VNNI's vpdpwssd, else AVX-512's
// or AVX2's vpmaddwd and an add; then scaled by d_w * d_x, plus an offset's m_w * s_x. 8-bit VNNI
// (vpdpbusd) would take two products per 15-bit activation (a byte each) for the same count of
// multiply-adds per instruction, so the 16-bit form is as fast and simpler.
// bf16 activations (the `int8` mode's Q8_0 blocks, scales of at most 8 significant bits): x rounded to
// bf16 times q held as bf16 (exact), AVX512-BF16's vdpbf16ps summing each block in fp32, scaled by
// d_w: one product per weight where the exact d * q needs two bf16 halves.
//
// Each output is acc = fma(block sum, d_w * d_x, acc) (+ fma(m_w, s_x, acc)) over the blocks in
// order, whatever the pass's shape, so a row's output is the same bits in any batch; the decode
// kernel and the tiles sum the same products in another order (the same to fp32 rounding).
//
// Weights in tile order (engine/models/linear.py, `tile_order`): for each 16 output columns and each
// block, 16 rows of 16 columns' values 2r and 2r + 1, the operand of a pair product; int8 for the
// integer formats, bf16 for bf16 activations. Threads split the columns; rows go in chunks that stay
// in the cache while the columns' weights pass.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;                    // output columns per group in tile order
constexpr int64_t kPairs = kBlock / 2;            // pair products per block
constexpr int64_t kPanelValues = kBlock * kGroup;  // one block of one group

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CBSERVE_VECTOR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CBSERVE_VECTOR_AVX2 1
#endif

// The operands of one call: x's rows (quantized, or rounded to bf16), the weights, the epilogue.
struct Operands {
  int64_t M, N, K, nb;
  const int16_t* xq;   // integer formats: (M, K) 15-bit values
  const float* xd;     // their scales (M, nbp)
  const float* xs;     // their scaled sums (M, nbp), which Q4_1's offsets multiply
  int64_t nbp;
  const uint16_t* xb;  // bf16 activations: (M, K) bf16 bits
  const int8_t* wq;    // integer weights in tile order (N / 16, nb, 512)
  const int16_t* ws;   // or 16-bit integer weights in tile order
  const uint16_t* wb;  // bf16 weights in tile order
  const float* scales;   // (nb, N)
  const float* offsets;  // (nb, N), Q4_1
  const float* bias;
  const float* residual;
  float* out;
};

inline int32_t pair_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(CBSERVE_VECTOR_AVX512) || defined(CBSERVE_VECTOR_AVX2)

#if defined(CBSERVE_VECTOR_AVX512)
struct Simd {
  static constexpr int64_t kLanes = 16;  // output columns per vector
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  // 16 columns' pair of int8 weights (32 bytes) widened to 16 bits, or of int16 weights as they are.
  static I widen(const int8_t* w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))); }
  static I widen(const int16_t* w) { return _mm512_loadu_si512(w); }
  static I broadcast(const void* pair) { return _mm512_set1_epi32(pair_at(pair)); }
  static I dot(I acc, I w, I x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
  }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
constexpr int kRowsPerPass = 4, kVectorsPerPass = 3;  // 12 int32 sums and 12 fp32 accumulators in 32 registers
#else
struct Simd {
  static constexpr int64_t kLanes = 8;
  using I = __m256i;
  using F = __m256;
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I widen(const int8_t* w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
  static I widen(const int16_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static I broadcast(const void* pair) { return _mm256_set1_epi32(pair_at(pair)); }
  static I dot(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
constexpr int kRowsPerPass = 3, kVectorsPerPass = 2;  // 16 registers
#endif

// Where vector v of a pass starting at column n0 reads block b's pair product p in tile order.
inline int64_t panel_at(int64_t n0, int v, int64_t nb, int64_t b, int64_t p) {
  const int64_t n = n0 + v * Simd::kLanes;
  return ((n / kGroup * nb + b) * kPairs + p) * 2 * kGroup + 2 * (n % kGroup);
}

// out (rows m0 .. m0 + MR, columns n0 .. n0 + V * kLanes) = residual + (a pass's sums + bias).
template <int MR, int V>
void write_out(const Simd::F (&acc)[MR][V], const Operands& o, int64_t m0, int64_t n0) {
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < V; ++v) {
      const int64_t n = n0 + v * Simd::kLanes, at = (m0 + r) * o.N + n;
      const Simd::F sum = Simd::add(acc[r][v], o.bias ? Simd::load(o.bias + n) : Simd::fzero());
      Simd::store(o.out + at, o.residual ? Simd::add(Simd::load(o.residual + at), sum) : sum);
    }
  }
}

// out (rows m0 .. m0 + MR, columns n0 .. n0 + V * kLanes) = residual + (x's rows times the weights + bias);
// W: the weights' integer type (int8 or int16).
template <typename W, bool Offsets, int MR, int V>
void integer_pass(const Operands& o, int64_t m0, int64_t n0) {
  const W* weights;
  if constexpr (sizeof(W) == 1) weights = o.wq; else weights = o.ws;
  Simd::F acc[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Simd::fzero();
  for (int64_t b = 0; b < o.nb; ++b) {
    Simd::I sums[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < V; ++v) sums[r][v] = Simd::izero();
#pragma GCC unroll 4
    for (int64_t p = 0; p < kPairs; ++p) {
      Simd::I w[V];
      for (int v = 0; v < V; ++v) w[v] = Simd::widen(weights + panel_at(n0, v, o.nb, b, p));
      for (int r = 0; r < MR; ++r) {
        const Simd::I x = Simd::broadcast(o.xq + (m0 + r) * o.K + b * kBlock + 2 * p);
        for (int v = 0; v < V; ++v) sums[r][v] = Simd::dot(sums[r][v], w[v], x);
      }
    }
    for (int v = 0; v < V; ++v) {
      const Simd::F dw = Simd::load(o.scales + b * o.N + n0 + v * Simd::kLanes);
      Simd::F mw;
      if constexpr (Offsets) mw = Simd::load(o.offsets + b * o.N + n0 + v * Simd::kLanes);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (m0 + r) * o.nbp + b;
        acc[r][v] = Simd::fma(Simd::to_float(sums[r][v]), Simd::mul(dw, Simd::set1(o.xd[at])), acc[r][v]);
        if constexpr (Offsets) acc[r][v] = Simd::fma(mw, Simd::set1(o.xs[at]), acc[r][v]);
      }
    }
  }
  write_out<MR, V>(acc, o, m0, n0);
}

#if defined(CBSERVE_VECTOR_AVX512) && defined(__AVX512BF16__)
#define CBSERVE_VECTOR_BF16 1
// integer_pass for bf16 activations: each block's pair products summed by vdpbf16ps, scaled by d_w.
template <int MR, int V>
void bf16_pass(const Operands& o, int64_t m0, int64_t n0) {
  __m512 acc[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < o.nb; ++b) {
    __m512 sums[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < V; ++v) sums[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh w[V];
      for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(o.wb + panel_at(n0, v, o.nb, b, p));
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair_at(o.xb + (m0 + r) * o.K + b * kBlock + 2 * p));
        for (int v = 0; v < V; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], w[v], x);
      }
    }
    for (int v = 0; v < V; ++v) {
      const __m512 dw = _mm512_loadu_ps(o.scales + b * o.N + n0 + v * 16);
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm512_fmadd_ps(sums[r][v], dw, acc[r][v]);
    }
  }
  write_out<MR, V>(acc, o, m0, n0);
}
#endif

// Pass<MR, V> for the pass's rows (1 .. kRowsPerPass) and vectors (1 .. kVectorsPerPass).
template <template <int, int> class Pass, int MR = kRowsPerPass>
void run_pass(int rows, int vectors, const Operands& o, int64_t m0, int64_t n0) {
  if constexpr (MR > 1) {
    if (rows < MR) return run_pass<Pass, MR - 1>(rows, vectors, o, m0, n0);
  }
  if (vectors >= 3 && kVectorsPerPass >= 3) return Pass<MR, kVectorsPerPass>::run(o, m0, n0);
  if (vectors == 2) return Pass<MR, 2>::run(o, m0, n0);
  Pass<MR, 1>::run(o, m0, n0);
}

template <typename W, bool Offsets>
struct IntegerPass {
  template <int MR, int V>
  struct Pass {
    static void run(const Operands& o, int64_t m0, int64_t n0) { integer_pass<W, Offsets, MR, V>(o, m0, n0); }
  };
};

#if defined(CBSERVE_VECTOR_BF16)
template <int MR, int V>
struct Bf16Pass {
  static void run(const Operands& o, int64_t m0, int64_t n0) { bf16_pass<MR, V>(o, m0, n0); }
};
#endif

// Every pass: threads split the column passes; each thread takes x in chunks (about 256 KiB) that
// stay in the cache while its columns' weights pass, and each pass's weights (a few KiB) serve the
// chunk's row tiles one after another.
template <template <int, int> class Pass>
void run_passes(const Operands& o, int64_t x_bytes) {
  const int64_t columns = kVectorsPerPass * Simd::kLanes;
  const int64_t column_passes = (o.N + columns - 1) / columns;
  const int64_t chunk_rows = std::max<int64_t>(kRowsPerPass, (int64_t(1) << 18) / (o.K * x_bytes)) / kRowsPerPass * kRowsPerPass;
  at::parallel_for(0, column_passes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < o.M; first += chunk_rows) {
      const int64_t last = std::min(o.M, first + chunk_rows);
      for (int64_t pass = begin; pass < end; ++pass) {
        const int64_t n0 = pass * columns;
        const int vectors = static_cast<int>(std::min<int64_t>(kVectorsPerPass, (o.N - n0) / Simd::kLanes));
        for (int64_t m0 = first; m0 < last; m0 += kRowsPerPass)
          run_pass<Pass>(static_cast<int>(std::min<int64_t>(kRowsPerPass, last - m0)), vectors, o, m0, n0);
      }
    }
  });
}

#else  // the plain loop, the same arithmetic per output

void plain_gemm(const Operands& o, bool bf16) {
  at::parallel_for(0, o.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < o.M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.f;
        for (int64_t b = 0; b < o.nb; ++b) {
          const int64_t group = ((n / kGroup * o.nb + b) * kPairs) * 2 * kGroup + 2 * (n % kGroup);
          const float dw = o.scales[b * o.N + n];
          if (bf16) {
            float sum = 0.f;
            for (int64_t p = 0; p < kPairs; ++p) {
              for (int64_t j = 0; j < 2; ++j) {
                const uint32_t xv = static_cast<uint32_t>(o.xb[m * o.K + b * kBlock + 2 * p + j]) << 16;
                const uint32_t wv = static_cast<uint32_t>(o.wb[group + p * 2 * kGroup + j]) << 16;
                float xf, wf;
                std::memcpy(&xf, &xv, 4);
                std::memcpy(&wf, &wv, 4);
                sum = std::fma(xf, wf, sum);
              }
            }
            acc = std::fma(sum, dw, acc);
          } else {
            int32_t sum = 0;
            for (int64_t p = 0; p < kPairs; ++p) {
              for (int64_t j = 0; j < 2; ++j) {
                const int64_t at = group + p * 2 * kGroup + j;
                sum += (o.wq ? static_cast<int32_t>(o.wq[at]) : static_cast<int32_t>(o.ws[at])) *
                       o.xq[m * o.K + b * kBlock + 2 * p + j];
              }
            }
            const int64_t at = m * o.nbp + b;
            acc = std::fma(static_cast<float>(sum), dw * o.xd[at], acc);
            if (o.offsets) acc = std::fma(o.offsets[b * o.N + n], o.xs[at], acc);
          }
        }
        const int64_t at = m * o.N + n;
        o.out[at] = (o.residual ? o.residual[at] : 0.f) + (acc + (o.bias ? o.bias[n] : 0.f));
      }
    }
  });
}

#endif

}  // namespace

std::string vector_gemm_isa() {
#if defined(CBSERVE_VECTOR_AVX512) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(CBSERVE_VECTOR_AVX512)
  return "avx512";
#elif defined(CBSERVE_VECTOR_AVX2)
  return "avx2";
#else
  return "plain";
#endif
}

bool vector_gemm_bf16() {
#if defined(CBSERVE_VECTOR_BF16)
  return true;
#elif defined(CBSERVE_VECTOR_AVX512) || defined(CBSERVE_VECTOR_AVX2)
  return false;
#else
  return true;  // the plain loop
#endif
}

torch::Tensor vector_gemm(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                          const c10::optional<torch::Tensor>& residual) {
  const bool bf16 = panels.scalar_type() == torch::kBFloat16, wide = panels.scalar_type() == torch::kShort;
  TORCH_CHECK(bf16 || wide || panels.scalar_type() == torch::kChar,
              "panels: int8 or int16 (integer formats) or bf16 (bf16 activations)");
  TORCH_CHECK(!bf16 || vector_gemm_bf16(), "vector_gemm with bf16 activations needs AVX512-BF16, which this CPU or build lacks");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanelValues,
              "panels: contiguous (N / 16, K / 32, 512) in tile order");
  const int64_t nb = panels.size(1), K = nb * kBlock, M = x.size(0), N = panels.size(0) * kGroup;
  check_prologue(x, K, norm_weight, gated);
  check_block_scales(scales, offsets, nb, N, bf16);
  check_bias_residual(bias, residual, M, N);
  auto out = torch::empty({M, N}, x.options());
  Scratch<float> transformed;
  const float* rows = with_prologue(x, M, K, norm_weight, eps, gated, transformed);
  QuantizedX qx{};
  Scratch<uint16_t> xb;
  if (bf16) {
    xb = scratch<uint16_t>(M * K);
    at::parallel_for(0, M * K, 4096, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) xb[i] = bf16_bits(rows[i]);
    });
  } else {
    qx = quantize_x(rows, M, K);
  }
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const Operands o{M, N, K, nb, qx.q.get(), qx.d.get(), qx.s.get(), qx.nbp, xb.get(),
                   panels.scalar_type() == torch::kChar ? panels.data_ptr<int8_t>() : nullptr,
                   wide ? panels.data_ptr<int16_t>() : nullptr,
                   bf16 ? reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()) : nullptr,
                   scales.data_ptr<float>(), offsets.has_value() ? offsets->data_ptr<float>() : nullptr,
                   b.defined() ? b.data_ptr<float>() : nullptr,
                   residual.has_value() ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>()};
#if defined(CBSERVE_VECTOR_AVX512) || defined(CBSERVE_VECTOR_AVX2)
  if (bf16) {
#if defined(CBSERVE_VECTOR_BF16)
    run_passes<Bf16Pass>(o, 2);
#endif
  } else if (wide) {
    if (o.offsets) run_passes<IntegerPass<int16_t, true>::Pass>(o, 2);
    else run_passes<IntegerPass<int16_t, false>::Pass>(o, 2);
  } else if (o.offsets) {
    run_passes<IntegerPass<int8_t, true>::Pass>(o, 2);
  } else {
    run_passes<IntegerPass<int8_t, false>::Pass>(o, 2);
  }
#else
  plain_gemm(o, bf16);
#endif
  return out;
}
