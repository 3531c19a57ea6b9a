// Matmul on GGUF block-quantized weights for decode-sized batches. As in llama.cpp, each row of x
// is quantized per block of 32 and every block's dot product is an integer sum scaled once; but to
// 15 bits (d = max |x| / 16256), not llama.cpp's 8: int8 activations cost SmolLM2-135M 3% of
// top-1 agreement with fp32, 15 bits nothing measurable. Q8_0 weights are widened to 16 bits and
// each block takes two 16-bit dot products (madd); Q4_1 nibbles are multiplied as bytes, each
// activation split exactly into two (below). A decode step is bound by the bytes of weights
// it reads (Q4_1 5 bits per weight, Q8_0 8.5, fp32 32) and by the instructions per block: four
// blocks' sums are reduced together and scaled by one vector multiply, and the scales of a row are
// stored apart from its quantized values, so they load and convert four at a time. torch has no
// kernel for these formats on CPU: its int8 paths want AVX-512 VNNI (fbgemm, oneDNN) or bf16
// activations, and quantize activations per tensor.
//
// Formats, one block of 32 weights as a GGUF file stores it (little-endian, unaligned):
//   Q8_0: fp16 d, int8 q[32]              w = d * q
//   Q4_1: fp16 d, fp16 m, uint8 nibbles[16] w = d * q + m; weight i < 16 is the low nibble of
//         byte i, weight i >= 16 the high nibble of byte i - 16
// The kernel reads each weight row regrouped (engine/models/linear.py, `regroup_rows`), the same
// bytes: the nb blocks' quantized values, then their nb scales d, then (Q4_1) their nb offsets m.
//
// Format 2 (kQ8_0Bf16) reads Q8_0 blocks whose scales have at most 8 significant bits (the `int8`
// mode's) and takes x rounded to bf16 instead: each weight d * q is then exact in fp32 and so is its
// product with x, which block_quant_gemm.cpp's bf16 tiles compute too (fp32 multiply-adds here).
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
constexpr int64_t kGroup = kQuantizedXGroup;  // blocks whose sums are scaled together
// How far ahead of the block in hand to ask for weight bytes: the hardware prefetcher alone kept two
// threads' streams to ~10-17 GB/s; lines requested 2 KiB ahead measured 1.15-1.19x on the layers'
// matmuls and 1.1-1.3x on the LM head (1, 3 and 4 KiB: 2-6% slower than 2, with the widened form
// alone). The byte form's loop streamed 100 MB at 60 GB/s 4 KiB ahead against 56 at 2 KiB, and the
// widened form 4 KiB ahead kept its speed in the engine (BENCHMARKS.md, the Q4_1 decode kernel).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kQ8_0 = kFormatQ8_0, kQ4_1 = kFormatQ4_1, kQ8_0Bf16 = kFormatQ8_0Bf16;

inline int64_t block_bytes(int64_t format) { return format == kQ4_1 ? 20 : 34; }  // the regrouped formats'

// x, computed as written: -ffast-math may not regroup the arithmetic around it (which it did
// differently per template instance, so a row's bits depended on its batch).
inline float in_order(float x) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  return __builtin_assoc_barrier(x);
#else
  return x;
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

}  // namespace

// quantize_x (kernels.h) is compiled without -ffast-math, which would fold 1 / (amax / 127) into
// 127 / amax and round some ties the other way: the same IEEE arithmetic as
// engine/models/linear.py's quantize_activations, so every path sees the same values.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock, nbp = (nb + kQuantizedXGroup - 1) / kQuantizedXGroup * kQuantizedXGroup;
  QuantizedX out{nbp, scratch<int16_t>(M * K), scratch<float>(M * nbp),
                 scratch<float>(M * nbp)};
  at::parallel_for(0, M, 32, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      std::fill(out.d.get() + m * nbp + nb, out.d.get() + (m + 1) * nbp, 0.f);  // the padding blocks
      std::fill(out.s.get() + m * nbp + nb, out.s.get() + (m + 1) * nbp, 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * kBlock;
        int16_t* qb = out.q.get() + m * K + b * kBlock;
        float amax = 0.f;
        int32_t sum = 0;
#if defined(__AVX512F__)
        const __m512 first = _mm512_loadu_ps(xb), second = _mm512_loadu_ps(xb + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
        const float d = amax / static_cast<float>(kLevels), id = d != 0.f ? 1.f / d : 0.f;
        constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i a = _mm512_cvt_roundps_epi32(_mm512_mul_ps(first, _mm512_set1_ps(id)), kNearest);
        const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(second, _mm512_set1_ps(id)), kNearest);
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm512_cvtepi32_epi16(a));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm512_cvtepi32_epi16(c));
#elif defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t i = 0; i < kBlock; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        for (float v : lanes) amax = std::max(amax, v);
        const float d = amax / static_cast<float>(kLevels), id = d != 0.f ? 1.f / d : 0.f;
        __m256i vsum = _mm256_setzero_si256();
        for (int64_t i = 0; i < kBlock; i += 16) {
          const __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), _mm256_set1_ps(id)),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          const __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), _mm256_set1_ps(id)),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          vsum = _mm256_add_epi32(vsum, _mm256_add_epi32(a, c));
          // packs interleaves the 128-bit halves: put them back in order
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i),
                              _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8));
        }
        int32_t parts[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), vsum);
        for (int32_t v : parts) sum += v;
#else
        for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / static_cast<float>(kLevels), id = d != 0.f ? 1.f / d : 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
          qb[i] = static_cast<int16_t>(v);
          sum += v;
        }
#endif
        out.d[m * nbp + b] = d;
        out.s[m * nbp + b] = d * static_cast<float>(sum);
      }
    }
  });
  return out;
}
#pragma GCC pop_options

namespace {

// A regrouped weight row of nb blocks: quantized values, fp16 scales, fp16 offsets (Q4_1).
template <int64_t Format>
struct Row {
  static constexpr int64_t kQuantBytes = Format == kQ8_0 ? 32 : 16;
  const uint8_t* quants;
  const uint8_t* scales;
  const uint8_t* offsets;
  Row(const uint8_t* row, int64_t nb)
      : quants(row), scales(row + nb * kQuantBytes), offsets(scales + 2 * nb) {}
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Block b's 32 weights widened to 16 bits, in x's order: lo = weights 0-15, hi = 16-31.
template <int64_t Format>
__attribute__((always_inline)) inline void widen(const Row<Format>& row, int64_t b, __m256i& lo, __m256i& hi) {
  const uint8_t* q = row.quants + b * Row<Format>::kQuantBytes;
  if constexpr (Format == kQ8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    hi = _mm256_srli_epi16(bytes, 4);
  }
}

// Eight int32 lanes whose sum is block b's integer dot product with the quantized row xq.
__attribute__((always_inline)) inline __m256i block_dot(__m256i lo, __m256i hi, const int16_t* xq, int64_t b) {
  const int16_t* xb = xq + b * kBlock;
  return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
                          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// Two blocks' lane sums folded pairwise: hadd keeps each block's lanes apart.
template <int64_t Format, int64_t MB>
__attribute__((always_inline)) inline void pair_dots(const Row<Format>& row, int64_t b, const int16_t* const* xq,
                                                     __m256i* pairs) {
  __m256i lo0, hi0, lo1, hi1;
  widen<Format>(row, b, lo0, hi0);
  widen<Format>(row, b + 1, lo1, hi1);
  for (int64_t i = 0; i < MB; ++i)
    pairs[i] = _mm256_hadd_epi32(block_dot(lo0, hi0, xq[i], b), block_dot(lo1, hi1, xq[i], b + 1));
}
#endif

#if defined(CBSERVE_BYTE_PRODUCTS)
// Q4_1 without widening, with AVX512-VNNI: the nibbles are multiplied as bytes. Each 15-bit
// activation is split exactly into x = 128 * h + l, h in [-127, 127] and l in [0, 127], both bytes
// (byte_order), so one vpdpbusd covers 64 weights where a 16-bit product covers 16. A 512-bit
// register holds four blocks' nibble bytes, one block per 128-bit lane: a mask and one shift give
// weights 0-15 and 16-31 of all four, and four vpdpbusd their integer dot products, exactly the
// widened form's. Lanes of partial sums are scaled as they stand (one float multiply-add per four
// blocks), not reduced across lanes first. At one or two tokens a pass reads several weight rows
// (kWeightPassBytes): their instructions interleave and the activation bytes load once for them.
// Without VNNI (vpmaddubsw and vpmaddwd for vpdpbusd) the byte form measured no faster, so other
// builds keep widening (BENCHMARKS.md).
// Weight rows a pass reads: at one token 4, 2 or 1, as many as fit in kWeightPassBytes; at two
// tokens at most 2 (a pass keeps at most four rows of sums); past two, 1. One thread, one token,
// weights out of cache: against one row a pass, two rows 1.24-1.41x on the embedded model's
// matmuls, four 1.33-1.49x where rows are short (K = 576) but 1.21x where they are long (K = 1536:
// four streams of 960 bytes).
constexpr int64_t kWeightPassBytes = 2048;
// A pass asks for its whole rows this far ahead, scales and offsets included (a stride over the
// quantized values skipped a fifth of each row): 8-12 KiB measured 1.1-1.2x over 4 KiB ahead of
// each block group, on the same measure.
constexpr int64_t kRowPrefetchBytes = 12288;

// x's rows (quantize_x's q) in byte order: for each group of four blocks b..b + 3 (nbp / 4 of
// them, the padding zero), four registers' bytes: h of x[0:16] of each block (16 bytes a block,
// in block order), h of x[16:32] likewise, then l the same.
Scratch<int8_t> byte_order(const QuantizedX& qx, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock, row_bytes = qx.nbp / kGroup * kQuadBytes;
  Scratch<int8_t> out = scratch<int8_t>(M * row_bytes);
  const __m256i low7 = _mm256_set1_epi16(127);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < qx.nbp; b += kGroup) {
      int8_t* o = out.get() + m * row_bytes + b / kGroup * kQuadBytes;
      for (int64_t j = 0; j < kGroup; ++j) {
        for (int64_t half = 0; half < 2; ++half) {
          const __m256i q = b + j < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             qx.q.get() + m * K + (b + j) * kBlock + 16 * half))
                                       : _mm256_setzero_si256();
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 64 * half + 16 * j), _mm256_cvtepi16_epi8(_mm256_srai_epi16(q, 7)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 128 + 64 * half + 16 * j),
                           _mm256_cvtepi16_epi8(_mm256_and_si256(q, low7)));
        }
      }
    }
  }
  return out;
}

// count (1-4) fp16 values at p as fp32, the rest zero; reads only their bytes.
__attribute__((always_inline)) inline __m128 halves(const uint8_t* p, int64_t count) {
  if (count == 4) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), p));
}

// Blocks b to b + Count - 1 (Count <= kGroup) of NR weight rows against MB rows of x:
// acc += lanes * d_w * d_x per block, offset_acc += m_w * s_x. Count is a template argument: a
// row's last blocks, short of a group, cost their own work and no branches; missing blocks' bytes
// are not read.
template <int64_t NR, int64_t MB, int64_t Count>
__attribute__((always_inline)) inline void byte_group(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t b,
                                                      const int8_t* const* xb,
                                                      const float* const* xd, const float* const* xs,
                                                      __m512 (&acc)[NR][MB], __m128 (&offset_acc)[NR][MB]) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // block of each lane
  for (int64_t r = 0; r < NR; ++r) {
    const Row<kQ4_1> row(w + r * row_bytes, nb);
    const uint8_t* q = row.quants + b * 16;
    const __m512i bytes = Count == kGroup ? _mm512_loadu_si512(q) : _mm512_maskz_loadu_epi8((1ull << (16 * Count)) - 1, q);
    const __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
    const __m128 dw = halves(row.scales + 2 * b, Count), mw = halves(row.offsets + 2 * b, Count);
    for (int64_t i = 0; i < MB; ++i) {
      const __m128 scales = _mm_mul_ps(dw, _mm_loadu_ps(xd[i] + b));
      acc[r][i] = _mm512_fmadd_ps(quad_dot(lo, hi, xb[i] + b / kGroup * kQuadBytes),
                                  _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales)), acc[r][i]);
      offset_acc[r][i] = _mm_fmadd_ps(mw, _mm_loadu_ps(xs[i] + b), offset_acc[r][i]);
    }
  }
}

// sums[r * MB + i] = Q4_1 weight row r (nb blocks, rows row_bytes apart from w) . row m0 + i of x
// (xb: in byte order), for r < NR, i < MB; Tail: nb % kGroup. Each row's arithmetic is the same
// whatever NR and MB are.
template <int64_t NR, int64_t MB, int64_t Tail>
inline void dot_rows_bytes(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, const int8_t* xb_rows,
                           int64_t m0, float* sums) {
  for (int64_t line = 0; line < NR * row_bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + line + kRowPrefetchBytes), _MM_HINT_T0);
  const int8_t* xb[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int64_t i = 0; i < MB; ++i) {
    xb[i] = xb_rows + (m0 + i) * qx.nbp / kGroup * kQuadBytes;
    xd[i] = qx.d.get() + (m0 + i) * qx.nbp;
    xs[i] = qx.s.get() + (m0 + i) * qx.nbp;
  }
  __m512 acc[NR][MB];
  __m128 offset_acc[NR][MB];
  for (int64_t r = 0; r < NR; ++r) {
    for (int64_t i = 0; i < MB; ++i) {
      acc[r][i] = _mm512_setzero_ps();
      offset_acc[r][i] = _mm_setzero_ps();
    }
  }
  int64_t b = 0;
  for (; b + kGroup <= nb; b += kGroup) byte_group<NR, MB, kGroup>(w, row_bytes, nb, b, xb, xd, xs, acc, offset_acc);
  if constexpr (Tail > 0) byte_group<NR, MB, Tail>(w, row_bytes, nb, b, xb, xd, xs, acc, offset_acc);
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t i = 0; i < MB; ++i) sums[r * MB + i] = _mm512_reduce_add_ps(acc[r][i]) + hsum_ps(offset_acc[r][i]);
}

// nr weight rows (1, 2 or 4) against mb rows of x, nr * mb <= 4.
template <int64_t NR, int64_t Tail>
inline void dot_pass_bytes(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, const int8_t* xb,
                           int64_t m0, int64_t mb, float* sums) {
  switch (mb) {
    case 1: dot_rows_bytes<NR, 1, Tail>(w, row_bytes, nb, qx, xb, m0, sums); break;
    case 2: if constexpr (NR <= 2) dot_rows_bytes<NR, 2, Tail>(w, row_bytes, nb, qx, xb, m0, sums); break;
    case 3: if constexpr (NR == 1) dot_rows_bytes<1, 3, Tail>(w, row_bytes, nb, qx, xb, m0, sums); break;
    default: if constexpr (NR == 1) dot_rows_bytes<1, 4, Tail>(w, row_bytes, nb, qx, xb, m0, sums); break;
  }
}

template <int64_t Tail>
inline void dot_pass_bytes(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, const int8_t* xb,
                           int64_t m0, int64_t mb, int64_t nr, float* sums) {
  switch (nr) {
    case 4: dot_pass_bytes<4, Tail>(w, row_bytes, nb, qx, xb, m0, mb, sums); break;
    case 2: dot_pass_bytes<2, Tail>(w, row_bytes, nb, qx, xb, m0, mb, sums); break;
    default: dot_pass_bytes<1, Tail>(w, row_bytes, nb, qx, xb, m0, mb, sums); break;
  }
}

inline void dot_pass_bytes(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, const int8_t* xb,
                           int64_t m0, int64_t mb, int64_t nr, float* sums) {
  switch (nb % kGroup) {
    case 0: dot_pass_bytes<0>(w, row_bytes, nb, qx, xb, m0, mb, nr, sums); break;
    case 1: dot_pass_bytes<1>(w, row_bytes, nb, qx, xb, m0, mb, nr, sums); break;
    case 2: dot_pass_bytes<2>(w, row_bytes, nb, qx, xb, m0, mb, nr, sums); break;
    default: dot_pass_bytes<3>(w, row_bytes, nb, qx, xb, m0, mb, nr, sums); break;
  }
}
#endif

// sums[i] = weight row (nb blocks) . row m0 + i of x, for i < MB (with AVX512-VNNI, Q8_0 rows: Q4_1
// takes dot_rows_bytes). Each weight block is widened once for the MB rows; Format and MB are
// template arguments so the layout is fixed and the accumulators stay in registers. Each row's
// arithmetic is the same whatever MB is (the last blocks' scalar sums held in order: -ffast-math
// regrouped them per MB).
template <int64_t Format, int64_t MB>
inline void dot_rows(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t m0, float* sums) {
  const Row<Format> row(w, nb);
  const int16_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int64_t i = 0; i < MB; ++i) {
    xq[i] = qx.q.get() + (m0 + i) * nb * kBlock;
    xd[i] = qx.d.get() + (m0 + i) * qx.nbp;
    xs[i] = qx.s.get() + (m0 + i) * qx.nbp;
  }
  float tail[MB] = {}, offsets[MB] = {};
  int64_t b = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m128 acc[MB], offset_acc[MB];
  for (int64_t i = 0; i < MB; ++i) acc[i] = offset_acc[i] = _mm_setzero_ps();
  for (; b + kGroup <= nb; b += kGroup) {
    for (int64_t line = 0; line < kGroup * Row<Format>::kQuantBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row.quants + b * Row<Format>::kQuantBytes + line + kPrefetchBytes),
                   _MM_HINT_T0);
    __m256i first[MB], second[MB];
    pair_dots<Format, MB>(row, b, xq, first);
    pair_dots<Format, MB>(row, b + 2, xq, second);
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.scales + 2 * b)));
    __m128 mw;
    if constexpr (Format == kQ4_1) mw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.offsets + 2 * b)));
    for (int64_t i = 0; i < MB; ++i) {
      const __m256i four = _mm256_hadd_epi32(first[i], second[i]);  // lanes: blocks b..b+3, per half
      const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(four), _mm256_extracti128_si256(four, 1));
      acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_mul_ps(dw, _mm_loadu_ps(xd[i] + b)), acc[i]);
      if constexpr (Format == kQ4_1) offset_acc[i] = _mm_fmadd_ps(mw, _mm_loadu_ps(xs[i] + b), offset_acc[i]);
    }
  }
  for (; b < nb; ++b) {
    __m256i lo, hi;
    widen<Format>(row, b, lo, hi);
    const float dw = half_at(row.scales + 2 * b), mw = Format == kQ4_1 ? half_at(row.offsets + 2 * b) : 0.f;
    for (int64_t i = 0; i < MB; ++i) {
      tail[i] = in_order(tail[i] + in_order(dw * xd[i][b]) * static_cast<float>(hsum_epi32(block_dot(lo, hi, xq[i], b))));
      if constexpr (Format == kQ4_1) offsets[i] = in_order(offsets[i] + mw * xs[i][b]);
    }
  }
  for (int64_t i = 0; i < MB; ++i) sums[i] = hsum_ps(acc[i]) + tail[i] + (hsum_ps(offset_acc[i]) + offsets[i]);
#else
  for (; b < nb; ++b) {
    const uint8_t* q = row.quants + b * Row<Format>::kQuantBytes;
    const float dw = half_at(row.scales + 2 * b), mw = Format == kQ4_1 ? half_at(row.offsets + 2 * b) : 0.f;
    for (int64_t i = 0; i < MB; ++i) {
      const int16_t* xb = xq[i] + b * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t wj = Format == kQ8_0 ? static_cast<int8_t>(q[j]) : (j < 16 ? q[j] & 0x0f : q[j - 16] >> 4);
        dot += wj * xb[j];
      }
      tail[i] = in_order(tail[i] + in_order(dw * xd[i][b]) * static_cast<float>(dot));
      if constexpr (Format == kQ4_1) offsets[i] = in_order(offsets[i] + mw * xs[i][b]);
    }
  }
  for (int64_t i = 0; i < MB; ++i) sums[i] = tail[i] + offsets[i];
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

// sums[i] = Q8_0 weight row (nb blocks) . row m0 + i of xr (M, K), already rounded to bf16: each
// block's weights d * q (exact in fp32) times x, summed in fp32; each row's sum the same whatever MB
// is. Compiled without -ffast-math, which would let the plain loop's sums be reordered per MB.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
template <int64_t MB>
inline void dot_rows_bf16(const uint8_t* w, int64_t nb, const float* xr, int64_t K, int64_t m0, float* sums) {
  const Row<kQ8_0> row(w, nb);
  const float* x[MB];
  for (int64_t i = 0; i < MB; ++i) x[i] = xr + (m0 + i) * K;
#if defined(__AVX512F__) && defined(__F16C__)
  // Four accumulators a row (two blocks' halves), so the multiply-adds do not wait on each other.
  __m512 acc[MB][4];
  for (int64_t i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const uint8_t* q = row.quants + b * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBytes), _MM_HINT_T0);
    const int64_t blocks = std::min<int64_t>(2, nb - b);
    for (int64_t j = 0; j < blocks; ++j) {
      const __m512 d = _mm512_set1_ps(half_at(row.scales + 2 * (b + j)));
      const uint8_t* qj = q + j * kBlock;
      const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qj)))));
      const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qj + 16)))));
      for (int64_t i = 0; i < MB; ++i) {
        const float* xb = x[i] + (b + j) * kBlock;
        acc[i][2 * j] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w0, acc[i][2 * j]);
        acc[i][2 * j + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w1, acc[i][2 * j + 1]);
      }
    }
  }
  for (int64_t i = 0; i < MB; ++i)
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3])));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // Four accumulators a row (a block's quarters), so the multiply-adds do not wait on each other.
  __m256 acc[MB][4];
  for (int64_t i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = row.quants + b * kBlock;
    if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBytes), _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half_at(row.scales + 2 * b));
    for (int64_t j = 0; j < 4; ++j) {
      const __m256 wj = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)))));
      for (int64_t i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + b * kBlock + 8 * j), wj, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < MB; ++i) {
    const __m256 all = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
    sums[i] = hsum_ps(_mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
  }
#else
  for (int64_t i = 0; i < MB; ++i) sums[i] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = row.quants + b * kBlock;
    const float d = half_at(row.scales + 2 * b);
    for (int64_t i = 0; i < MB; ++i)
      for (int64_t j = 0; j < kBlock; ++j) sums[i] += x[i][b * kBlock + j] * (d * static_cast<float>(static_cast<int8_t>(q[j])));
  }
#endif
}

inline void dot_pass_bf16(const uint8_t* w, int64_t nb, const float* xr, int64_t K, int64_t m0, int64_t mb, float* sums) {
  switch (mb) {
    case 1: dot_rows_bf16<1>(w, nb, xr, K, m0, sums); break;
    case 2: dot_rows_bf16<2>(w, nb, xr, K, m0, sums); break;
    case 3: dot_rows_bf16<3>(w, nb, xr, K, m0, sums); break;
    default: dot_rows_bf16<4>(w, nb, xr, K, m0, sums); break;
  }
}
#pragma GCC pop_options

// x (M, K) rounded to bf16, kept as fp32 (exact).
Scratch<float> round_bf16(const float* x, int64_t M, int64_t K) {
  Scratch<float> out = scratch<float>(M * K);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t at = m0 * K; at < m1 * K; ++at) {
      const uint32_t bits = static_cast<uint32_t>(bf16_bits(x[at])) << 16;
      std::memcpy(out.get() + at, &bits, 4);
    }
  });
  return out;
}

// act(gate) * up over one row, for one of the gated prologues (kernels.h's kGated codes), in fp32 as torch
// computes it; the activation is a template argument, chosen once for the rows, not per value.
template <int64_t Gated>
void gated_row(const float* gate, int64_t K, float* y) {
  for (int64_t k = 0; k < K; ++k) {
    const float g = gate[k];
    float a;
    if constexpr (Gated == kGatedSilu) {
      a = g / (1.f + std::exp(-g));
    } else if constexpr (Gated == kGatedGeluTanh) {
      a = 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    } else {
      a = 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f));
    }
    y[k] = a * gate[K + k];
  }
}

// RMSNorm(x) * norm_weight, or the gated activation act(x[:, :K]) * x[:, K:] (x twice as wide as the weight):
// with_prologue's rows.
Scratch<float> prologue(const float* x, int64_t M, int64_t K, const float* norm_weight, float eps, int64_t gated) {
  Scratch<float> rows = scratch<float>(M * K);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* y = rows.get() + m * K;
      const float* gate = x + m * 2 * K;
      if (gated == kGatedSilu) {
        gated_row<kGatedSilu>(gate, K, y);
      } else if (gated == kGatedGeluTanh) {
        gated_row<kGatedGeluTanh>(gate, K, y);
      } else if (gated == kGatedGelu) {
        gated_row<kGatedGelu>(gate, K, y);
      } else {
        rms_norm_row(x + m * K, norm_weight, K, eps, y);
      }
    }
  });
  return rows;
}

}  // namespace

const float* rows_after_prologue(const float* x, int64_t M, int64_t K, const float* norm_weight, double eps,
                                 int64_t gated, Scratch<float>& transformed) {
  if (!gated && norm_weight == nullptr) return x;
  transformed = prologue(x, M, K, norm_weight, static_cast<float>(eps), gated);
  return transformed.get();
}

const float* with_prologue(const torch::Tensor& x, int64_t M, int64_t K, const c10::optional<torch::Tensor>& norm_weight,
                           double eps, int64_t gated, Scratch<float>& transformed) {
  return rows_after_prologue(x.data_ptr<float>(), M, K,
                             norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr, eps, gated,
                             transformed);
}

void check_prologue(const torch::Tensor& x, int64_t K, const c10::optional<torch::Tensor>& norm_weight, int64_t gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) == (gated ? 2 * K : K), "x: contiguous fp32 (M, K), (M, 2K) with a gated activation");
  TORCH_CHECK(gated >= 0 && gated <= kGatedGelu, "gated: 0 (none), 1 (silu), 2 (gelu tanh) or 3 (gelu)");
  TORCH_CHECK(!(gated && norm_weight.has_value()), "one prologue: norm or gated activation");
  TORCH_CHECK(!norm_weight.has_value() || (norm_weight->scalar_type() == torch::kFloat &&
                  norm_weight->is_contiguous() && norm_weight->numel() == K), "norm_weight: fp32 (K)");
}

void check_bias_residual(const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual,
                         int64_t M, int64_t N) {
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->numel() == N), "bias: fp32 (N)");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == torch::kFloat && residual->is_contiguous() &&
                  residual->size(0) == M && residual->size(1) == N), "residual: contiguous fp32 (M, N)");
}

void check_block_scales(const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets, int64_t nb, int64_t N,
                        bool bf16_activations) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(0) == nb &&
                  scales.size(1) == N, "scales: contiguous fp32 (K / 32, N)");
  TORCH_CHECK(!offsets.has_value() || (offsets->scalar_type() == torch::kFloat && offsets->is_contiguous() &&
                  offsets->sizes() == scales.sizes()), "offsets: contiguous fp32 (K / 32, N)");
  TORCH_CHECK(!(bf16_activations && offsets.has_value()), "bf16 activations take Q8_0 blocks: no offsets");
}

torch::Tensor kernel_activations(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight, double eps,
                                 int64_t gated, bool bf16) {
  const int64_t M = x.size(0), K = gated ? x.size(1) / 2 : x.size(1);
  check_prologue(x, K, norm_weight, gated);
  TORCH_CHECK(bf16 || K % kBlock == 0, "K: a multiple of 32 (activations quantized per block)");
  Scratch<float> transformed;
  const float* rows = with_prologue(x, M, K, norm_weight, eps, gated, transformed);
  auto out = torch::empty({M, K}, x.options());
  float* op = out.data_ptr<float>();
  if (bf16) {
    const Scratch<float> xr = round_bf16(rows, M, K);
    std::memcpy(op, xr.get(), sizeof(float) * M * K);
    return out;
  }
  const QuantizedX qx = quantize_x(rows, M, K);
  at::parallel_for(0, M, 32, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; ++k) op[m * K + k] = static_cast<float>(qx.q[m * K + k]) * qx.d[m * qx.nbp + k / kBlock];
  });
  return out;
}

int64_t format_row_bytes(int64_t format, int64_t K) {
  return format <= kQ8_0Bf16 ? K / kBlock * block_bytes(format) : stored_row_bytes(format, K);
}

int64_t format_row_columns(int64_t format, int64_t bytes) {
  return format <= kQ8_0Bf16 ? bytes / block_bytes(format) * kBlock : stored_row_columns(format, bytes);
}

bool WeightRows::has(int64_t format) const {
  return std::find(formats.begin(), formats.end(), format) != formats.end();
}

WeightRows weight_rows(std::vector<torch::Tensor> parts, std::vector<int64_t> formats) {
  TORCH_CHECK(!parts.empty() && parts.size() == formats.size(), "parts, formats: one format per part, at least one");
  WeightRows w{std::move(parts), std::move(formats), {0}, 0};
  for (size_t p = 0; p < w.parts.size(); ++p) {
    const torch::Tensor& rows = w.parts[p];
    const int64_t format = w.formats[p];
    TORCH_CHECK(format >= kFormatQ8_0 && format <= kFormatIQ4_XS, "format: a KERNEL_FORMATS code (0-9)");
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kByte && rows.is_contiguous(),
                "a part's rows: contiguous uint8 (rows, row bytes)");
    const int64_t K = format_row_columns(format, rows.size(1));
    TORCH_CHECK(K > 0 && format_row_bytes(format, K) == rows.size(1) && (p == 0 || K == w.K),
                "every part's rows: the same K weights, whole blocks of their format");
    w.K = K;
    w.first.push_back(w.first.back() + rows.size(0));
  }
  TORCH_CHECK(!w.has(kQ8_0Bf16) || w.parts.size() == 1, "bf16 activations (format 2): one part");
  return w;
}

LinearInput linear_input(const float* x, int64_t M, int64_t K, const float* norm_weight, double eps, int64_t gated,
                         const WeightRows& w) {
  LinearInput in{M, K};
  const float* rows = rows_after_prologue(x, M, K, norm_weight, eps, gated, in.transformed);
  if (w.has(kQ8_0Bf16)) {
    in.xr = round_bf16(rows, M, K);
    return in;
  }
  in.qx = quantize_x(rows, M, K);
#if defined(CBSERVE_BYTE_PRODUCTS)
  if (std::any_of(w.formats.begin(), w.formats.end(), [](int64_t f) { return f == kQ4_1 || stored_byte_form(f); }))
    in.xb = byte_order(in.qx, M, K);
#endif
  return in;
}

namespace {

// out[m, n] for the pass's rows [n, n + nr) of weights and [m0, m0 + mb) of x, from the pass's
// sums (sums[r * mb + i]); a residual may be out itself: each element is read before it is
// written, by this row's thread.
inline void store_pass(const float* sums, int64_t n, int64_t nr, int64_t m0, int64_t mb, int64_t N, const float* bias,
                       const float* residual, float* out) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t i = 0; i < mb; ++i) {
      const int64_t at = (m0 + i) * N + n + r;
      out[at] = (residual ? residual[at] : 0.f) + (sums[r * mb + i] + (bias ? bias[n + r] : 0.f));
    }
  }
}

#if defined(CBSERVE_BYTE_PRODUCTS)
// part_rows on Q4_1 rows in the byte form: at one or two tokens a pass reads several weight rows.
void linear_rows_bytes(const LinearInput& in, const uint8_t* blocks, int64_t N, int64_t first, const float* bias,
                       const float* residual, float* out, int64_t n0, int64_t n1) {
  const int64_t M = in.M, nb = in.K / kBlock, row_bytes = nb * block_bytes(kQ4_1);
  // kWeightPassBytes' rule: 4, 2 or 1 rows at one token, at most 2 at two, 1 past two
  const int64_t fit = kWeightPassBytes / row_bytes;
  int64_t weight_rows = 1;
  if (M == 1 && fit >= 4) weight_rows = 4;
  else if (M <= 2 && fit >= 2) weight_rows = 2;
  float sums[kRowsPerPass];  // nr * mb <= kRowsPerPass
  for (int64_t n = n0; n < n1;) {
    const int64_t left = n1 - n, nr = weight_rows <= left ? weight_rows : left >= 2 ? 2 : 1;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t mb = std::min(kRowsPerPass, M - m0);
      dot_pass_bytes(blocks + n * row_bytes, row_bytes, nb, in.qx, in.xb.get(), m0, mb, nr, sums);
      store_pass(sums, first + n, nr, m0, mb, N, bias, residual, out);
    }
    n += nr;
  }
}
#endif

// linear_rows over one part's rows [n0, n1) (part-relative), written to out's rows offset by `first`.
void part_rows(const LinearInput& in, const uint8_t* blocks, int64_t format, int64_t N, int64_t first,
               const float* bias, const float* residual, float* out, int64_t n0, int64_t n1) {
#if defined(CBSERVE_BYTE_PRODUCTS)
  if (format == kQ4_1) return linear_rows_bytes(in, blocks, N, first, bias, residual, out, n0, n1);
#endif
  const int64_t M = in.M, nb = in.K / kBlock, row_bytes = format_row_bytes(format, in.K);
  float sums[kRowsPerPass];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t mb = std::min(kRowsPerPass, M - m0);
      if (format == kQ8_0Bf16) {
        dot_pass_bf16(row, nb, in.xr.get(), in.K, m0, mb, sums);
      } else if (format == kQ8_0) {
        dot_pass<kQ8_0>(row, nb, in.qx, m0, mb, sums);
      } else if (format == kQ4_1) {
        dot_pass<kQ4_1>(row, nb, in.qx, m0, mb, sums);
      } else {
        stored_dot_pass(row, format, nb, in.qx, in.xb.get(), m0, mb, sums);
      }
      store_pass(sums, first + n, 1, m0, mb, N, bias, residual, out);
    }
  }
}

}  // namespace

void linear_rows(const LinearInput& in, const WeightRows& w, const float* bias, const float* residual, float* out,
                 int64_t n0, int64_t n1) {
  for (size_t p = 0; p < w.parts.size(); ++p) {
    const int64_t first = w.first[p], begin = std::max(n0, first), end = std::min(n1, w.first[p + 1]);
    if (begin < end)
      part_rows(in, w.parts[p].data_ptr<uint8_t>(), w.formats[p], w.N(), first, bias, residual, out, begin - first,
                end - first);
  }
}

torch::Tensor block_quant_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                                 const std::vector<int64_t>& formats, const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                                 const c10::optional<torch::Tensor>& residual) {
  const WeightRows w = weight_rows(parts, formats);
  const int64_t N = w.N(), K = w.K, M = x.size(0);
  check_prologue(x, K, norm_weight, gated);
  check_bias_residual(bias, residual, M, N);
  const LinearInput in = linear_input(x.data_ptr<float>(), M, K,
                                      norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr, eps, gated, w);
  auto out = torch::empty({M, N}, x.options());
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { linear_rows(in, w, bp, rp, op, n0, n1); });
  return out;
}
