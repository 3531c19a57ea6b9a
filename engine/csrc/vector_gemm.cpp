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
// kernel and the AMX tiles sum the same products in another order (the same to fp32 rounding).
//
// The weights are the decode kernel's rows (a GGUF file's blocks, mapped): no other copy of them is
// kept. Each pass unpacks its 16-48 columns (unpack_row: the integers q, d and m of every block)
// into a panel in tile order, for each 16 output columns and each block 16 rows of 16 columns'
// values 2r and 2r + 1, the operand of a pair product (int8 for the integer formats, int16 for
// Q6_K, bf16 for bf16 activations), and runs every row of x over it: a weight is unpacked once a
// call, which past a few dozen rows costs a small share of the products (BENCHMARKS.md). Threads
// split the passes.
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
  const int8_t* wq;    // integer weights of columns [w0, w0 + wN) in tile order (wN / 16, nb, 512)
  const int16_t* ws;   // or 16-bit integer weights in tile order
  const uint16_t* wb;  // bf16 weights in tile order
  const float* scales;   // (nb, wN)
  const float* offsets;  // (nb, wN), or null where no part has offsets
  int64_t w0, wN;        // the columns the weights above hold
  const float* bias;
  const float* residual;
  float* out;
};

inline int32_t pair_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Where column c's value k of block b sits in tile order: per 16 columns and block, 16 pairs of the
// 16 columns' values 2r and 2r + 1.
inline int64_t tile_at(int64_t c, int64_t nb, int64_t b, int64_t k) {
  return ((c / kGroup * nb + b) * kPairs + k / 2) * 2 * kGroup + 2 * (c % kGroup) + k % 2;
}

// Columns [w0, w0 + wN) of the weights (wN a multiple of 16), unpacked from their rows as a pass reads them.
struct Panel {
  Scratch<int8_t> q8;
  Scratch<int16_t> q16;
  Scratch<uint16_t> qb;
  Scratch<float> d, m;
  Scratch<int16_t> row_q;
  Scratch<float> row_d, row_m;
  Panel(int64_t columns, int64_t nb, bool wide, bool bf16)
      : d(scratch<float>(nb * columns)), m(scratch<float>(nb * columns)), row_q(scratch<int16_t>(nb * kBlock)),
        row_d(scratch<float>(nb)), row_m(scratch<float>(nb)) {
    if (bf16) qb = scratch<uint16_t>(nb * kBlock * columns);
    else if (wide) q16 = scratch<int16_t>(nb * kBlock * columns);
    else q8 = scratch<int8_t>(nb * kBlock * columns);
  }

  // Column c's unpacked row (row_q) into the panel in tile order, each value as `as` gives it.
  template <typename T, typename As>
  void place(T* panel, int64_t c, int64_t nb, As as) const {
    T* column = panel + tile_at(c, nb, 0, 0);
    for (int64_t b = 0; b < nb; ++b) {
      const int16_t* q = row_q.get() + b * kBlock;
      T* pairs = column + b * kPairs * 2 * kGroup;
      for (int64_t p = 0; p < kPairs; ++p) {
        pairs[p * 2 * kGroup] = as(q[2 * p]);
        pairs[p * 2 * kGroup + 1] = as(q[2 * p + 1]);
      }
    }
  }

  // Fills the panel with columns [w0, w0 + wN) and points o's weights at it (and its offsets, `offsets`).
  void unpack(const WeightRows& w, int64_t w0, int64_t wN, bool offsets, Operands& o) {
    const int64_t nb = o.nb;
    for (int64_t c = 0; c < wN; ++c) {
      const int64_t n = w0 + c;
      const size_t part = std::upper_bound(w.first.begin(), w.first.end(), n) - w.first.begin() - 1;
      const torch::Tensor& rows = w.parts[part];
      unpack_row(w.formats[part], rows.data_ptr<uint8_t>() + (n - w.first[part]) * rows.size(1), nb, row_q.get(),
                 row_d.get(), row_m.get());
      for (int64_t b = 0; b < nb; ++b) {
        d[b * wN + c] = row_d[b];
        m[b * wN + c] = row_m[b];
      }
      if (qb) place(qb.get(), c, nb, [](int16_t v) { return bf16_bits(static_cast<float>(v)); });
      else if (q16) place(q16.get(), c, nb, [](int16_t v) { return v; });
      else place(q8.get(), c, nb, [](int16_t v) { return static_cast<int8_t>(v); });
    }
    o.wq = q8.get();
    o.ws = q16.get();
    o.wb = qb.get();
    o.scales = d.get();
    o.offsets = offsets ? m.get() : nullptr;
    o.w0 = w0;
    o.wN = wN;
  }
};

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
inline int64_t panel_at(const Operands& o, int64_t n0, int v, int64_t b, int64_t p) {
  return tile_at(n0 - o.w0 + v * Simd::kLanes, o.nb, b, 2 * p);
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
      for (int v = 0; v < V; ++v) w[v] = Simd::widen(weights + panel_at(o, n0, v, b, p));
      for (int r = 0; r < MR; ++r) {
        const Simd::I x = Simd::broadcast(o.xq + (m0 + r) * o.K + b * kBlock + 2 * p);
        for (int v = 0; v < V; ++v) sums[r][v] = Simd::dot(sums[r][v], w[v], x);
      }
    }
    for (int v = 0; v < V; ++v) {
      const Simd::F dw = Simd::load(o.scales + b * o.wN + n0 - o.w0 + v * Simd::kLanes);
      Simd::F mw;
      if constexpr (Offsets) mw = Simd::load(o.offsets + b * o.wN + n0 - o.w0 + v * Simd::kLanes);
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
      for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(o.wb + panel_at(o, n0, v, b, p));
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair_at(o.xb + (m0 + r) * o.K + b * kBlock + 2 * p));
        for (int v = 0; v < V; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], w[v], x);
      }
    }
    for (int v = 0; v < V; ++v) {
      const __m512 dw = _mm512_loadu_ps(o.scales + b * o.wN + n0 - o.w0 + v * 16);
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

// Every pass: threads split the column passes; each unpacks its pass's columns from their rows
// (a few KiB a block, int8: 16-48 columns of K weights) and runs every row of x over them, so a
// weight is unpacked once a call whatever the batch.
template <template <int, int> class Pass>
void run_passes(const Operands& o, const WeightRows& w, bool wide, bool bf16, bool offsets) {
  const int64_t columns = kVectorsPerPass * Simd::kLanes;
  const int64_t column_passes = (o.N + columns - 1) / columns;
  at::parallel_for(0, column_passes, 1, [&](int64_t begin, int64_t end) {
    Panel panel(columns, o.nb, wide, bf16);
    Operands local = o;
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t n0 = pass * columns, width = std::min(columns, o.N - n0);
      panel.unpack(w, n0, width, offsets, local);
      const int vectors = static_cast<int>(width / Simd::kLanes);
      for (int64_t m0 = 0; m0 < o.M; m0 += kRowsPerPass)
        run_pass<Pass>(static_cast<int>(std::min<int64_t>(kRowsPerPass, o.M - m0)), vectors, local, m0, n0);
    }
  });
}

#else  // the plain loop, the same arithmetic per output

void plain_gemm(Operands o, const WeightRows& w, bool wide, bool bf16, bool offsets) {
  Panel panel(o.N, o.nb, wide, bf16);
  panel.unpack(w, 0, o.N, offsets, o);
  at::parallel_for(0, o.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < o.M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.f;
        for (int64_t b = 0; b < o.nb; ++b) {
          const int64_t group = ((n / kGroup * o.nb + b) * kPairs) * 2 * kGroup + 2 * (n % kGroup);
          const float dw = o.scales[b * o.wN + n];
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
            if (o.offsets) acc = std::fma(o.offsets[b * o.wN + n], o.xs[at], acc);
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

torch::Tensor vector_gemm(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const std::vector<int64_t>& formats, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                          const c10::optional<torch::Tensor>& residual) {
  const WeightRows w = weight_rows(parts, formats);
  const bool bf16 = w.has(kFormatQ8_0Bf16), wide = w.has(kFormatQ6_K);
  const bool offsets = w.has(kFormatQ4_1) || w.has(kFormatQ5_1) || w.has(kFormatQ4_K) || w.has(kFormatQ5_K);
  TORCH_CHECK(!bf16 || vector_gemm_bf16(), "vector_gemm with bf16 activations needs AVX512-BF16, which this CPU or build lacks");
  const int64_t K = w.K, nb = K / kBlock, M = x.size(0), N = w.N();
  TORCH_CHECK(N % kGroup == 0, "vector_gemm: whole groups of 16 output columns");
  check_prologue(x, K, norm_weight, gated);
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
  // the weights, scales and offsets are each pass's panel's (Panel::unpack)
  const Operands o{M, N, K, nb, qx.q.get(), qx.d.get(), qx.s.get(), qx.nbp, xb.get(), nullptr, nullptr, nullptr,
                   nullptr, nullptr, 0, N,
                   b.defined() ? b.data_ptr<float>() : nullptr,
                   residual.has_value() ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>()};
#if defined(CBSERVE_VECTOR_AVX512) || defined(CBSERVE_VECTOR_AVX2)
  if (bf16) {
#if defined(CBSERVE_VECTOR_BF16)
    run_passes<Bf16Pass>(o, w, wide, bf16, offsets);
#endif
  } else if (wide) {
    if (offsets) run_passes<IntegerPass<int16_t, true>::Pass>(o, w, wide, bf16, offsets);
    else run_passes<IntegerPass<int16_t, false>::Pass>(o, w, wide, bf16, offsets);
  } else if (offsets) {
    run_passes<IntegerPass<int8_t, true>::Pass>(o, w, wide, bf16, offsets);
  } else {
    run_passes<IntegerPass<int8_t, false>::Pass>(o, w, wide, bf16, offsets);
  }
#else
  plain_gemm(o, w, wide, bf16, offsets);
#endif
  return out;
}
