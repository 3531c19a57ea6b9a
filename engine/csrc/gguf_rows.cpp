// The decode kernel's dot products for the GGUF types read as the file stores them (Q4_0, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K, IQ4_XS; engine/models/gguf_types.py): block_quant_linear.cpp's arithmetic
// for its Q8_0 and Q4_1 rows, on blocks unpacked in registers. Each block of 32 weights becomes
// 16-bit integers q and fp32 d (and m) with w = d * q (+ m) exactly, the file's numbers: a K-quant's
// sub-block scale d * sc computed in fp32 as gguf computes it, Q6_K's 16-weight sub-scales folded
// into q (|sc * (q - 32)| <= 4064, so a block's 32 products with 15-bit activations stay below 2^31),
// IQ4_XS's codebook looked up by byte shuffle. The dot product per block is exact in int32, scaled
// by d_w * d_x, plus m_w * s_x; four blocks' sums are scaled by one vector multiply-add, as for
// Q8_0. A row reads its bytes once, in order: a decode step is bound by them (4.5 bits a weight for
// Q4_K, 5.5 for Q5_K, 6.56 for Q6_K, 4.25 for IQ4_XS), and a K-quant's scales are decoded from its
// 12 bytes once per four blocks rather than stored widened.
#include "kernels.h"
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetchBytes = 2048;  // block_quant_linear.cpp's measure for its rows
constexpr int8_t kIq4Table[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float half_of(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// x, computed as written: -ffast-math may not regroup the arithmetic around it (floats and vectors).
template <typename T>
inline T in_order(T x) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  return __builtin_assoc_barrier(x);
#else
  return x;
#endif
}

// A K-quant's sub-block scales and mins (Q4_K, Q5_K: 6 bits each, packed in 12 bytes) for sub-blocks
// [first, first + 4), as gguf's get_scale_min reads them.
inline void k_scales(const uint8_t* s, int64_t first, int32_t* sc, int32_t* mn) {
  for (int64_t j = first; j < first + 4; ++j) {
    if (j < 4) {
      sc[j - first] = s[j] & 63;
      mn[j - first] = s[j + 4] & 63;
    } else {
      sc[j - first] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn[j - first] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
}

// Stored bytes per block and weights per block of each format.
constexpr int64_t stored_bytes(int64_t format) {
  switch (format) {
    case kFormatQ4_0: return 18;
    case kFormatQ5_0: return 22;
    case kFormatQ5_1: return 24;
    case kFormatQ4_K: return 144;
    case kFormatQ5_K: return 176;
    case kFormatQ6_K: return 210;
    default: return 136;  // IQ4_XS
  }
}
constexpr int64_t stored_weights(int64_t format) { return format >= kFormatQ4_K ? 256 : kBlock; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The bytes of the blocks a few quads ahead of block b (4 blocks: 72-105 bytes), asked for into the cache.
template <int64_t Format>
inline void prefetch_quad(const uint8_t* row, int64_t b) {
  const int64_t at = b * kBlock * stored_bytes(Format) / stored_weights(Format);
  _mm_prefetch(reinterpret_cast<const char*>(row + at + kPrefetchBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + at + kPrefetchBytes + 64), _MM_HINT_T0);
}
#endif

// Block b (32 weights) of a row as integers q[32] and d, m: the scalar form every build has.
template <int64_t Format>
void unpack_block(const uint8_t* row, int64_t b, int16_t* q, float& d, float& m) {
  m = 0.f;
  if constexpr (Format == kFormatQ4_0 || Format == kFormatQ5_0 || Format == kFormatQ5_1) {
    const uint8_t* p = row + b * stored_bytes(Format);
    d = half_of(p);
    const uint8_t* qs = p + (Format == kFormatQ4_0 ? 2 : Format == kFormatQ5_0 ? 6 : 8);
    const uint32_t qh = Format == kFormatQ4_0 ? 0 : u32_at(p + (Format == kFormatQ5_0 ? 2 : 4));
    if (Format == kFormatQ5_1) m = half_of(p + 2);
    const int16_t bias = Format == kFormatQ4_0 ? 8 : Format == kFormatQ5_0 ? 16 : 0;
    for (int64_t j = 0; j < 16; ++j) {
      q[j] = static_cast<int16_t>((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - bias;
      q[j + 16] = static_cast<int16_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias;
    }
  } else if constexpr (Format == kFormatQ4_K || Format == kFormatQ5_K) {
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t j = b % 8;
    int32_t sc[4], mn[4];
    k_scales(p + 4, j / 4 * 4, sc, mn);
    d = half_of(p) * static_cast<float>(sc[j % 4]);
    m = -(half_of(p + 2) * static_cast<float>(mn[j % 4]));
    const uint8_t* qs = p + (Format == kFormatQ4_K ? 16 : 48) + (j / 2) * 32;
    for (int64_t l = 0; l < 32; ++l) {
      int16_t v = j % 2 ? qs[l] >> 4 : qs[l] & 0x0F;
      if (Format == kFormatQ5_K) v |= ((p[16 + l] >> j) & 1) << 4;
      q[l] = v;
    }
  } else if constexpr (Format == kFormatQ6_K) {
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t r = b % 8, h = r / 4, k = (r % 4) / 2, j = r % 2;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    d = half_of(p + 208);
    for (int64_t c = 0; c < 32; ++c) {
      const int32_t low = (p[h * 64 + j * 32 + c] >> (4 * k)) & 0x0F;
      const int32_t high = (p[128 + h * 32 + c] >> (2 * (2 * k + j))) & 3;
      q[c] = static_cast<int16_t>(((low | (high << 4)) - 32) * sc[2 * r + c / 16]);
    }
  } else {  // IQ4_XS
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t j = b % 8;
    uint16_t scales_h;
    std::memcpy(&scales_h, p + 2, 2);
    const int32_t ls = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((scales_h >> (2 * j)) & 3) << 4);
    d = half_of(p) * static_cast<float>(ls - 32);
    const uint8_t* qs = p + 8 + j * 16;
    for (int64_t l = 0; l < 16; ++l) {
      q[l] = kIq4Table[qs[l] & 0x0F];
      q[l + 16] = kIq4Table[qs[l] >> 4];
    }
  }
}

// A row's nb blocks as unpack_block gives each.
template <int64_t Format>
void unpack_blocks(const uint8_t* row, int64_t nb, int16_t* q, float* d, float* m) {
  for (int64_t b = 0; b < nb; ++b) unpack_block<Format>(row, b, q + b * kBlock, d[b], m[b]);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Four blocks [b, b + 4) in registers: each block's weights 0-15 (lo) and 16-31 (hi) as int16,
// their d and m.
struct Quad {
  __m256i lo[4], hi[4];
  __m128 d, m;
};

inline __m256i nibbles_low(__m128i bytes) { return _mm256_and_si256(_mm256_cvtepu8_epi16(bytes), _mm256_set1_epi16(0x0F)); }
inline __m256i nibbles_high(__m128i bytes) { return _mm256_srli_epi16(_mm256_cvtepu8_epi16(bytes), 4); }

// Bit i of the 16 bits `bits` in int16 lane i, times 16.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i lanes = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<int16_t>(-32768));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lanes), lanes);
  return _mm256_and_si256(set, _mm256_set1_epi16(16));
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Sub-blocks [first, first + 4) of the Q4_K or Q5_K super-block at p: d * sc and -(dmin * mn), as gguf
// computes them. The 6-bit scales and mins of all eight sub-blocks are unpacked in three 32-bit
// words (gguf's get_scale_min, eight at once), and reach the vectors without a trip through memory.
inline void k_quad_scales(const uint8_t* p, int64_t first, __m128& d, __m128& m) {
  uint32_t u[3];
  std::memcpy(u, p + 4, 12);
  const uint64_t sc = (u[0] & 0x3f3f3f3fu) |
                      static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  const uint64_t mn = (u[1] & 0x3f3f3f3fu) |
                      static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
  const __m128 sc4 = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(sc >> (8 * first)))));
  const __m128 mn4 = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(mn >> (8 * first)))));
  d = in_order(_mm_mul_ps(_mm_set1_ps(half_of(p)), sc4));
  m = in_order(_mm_sub_ps(_mm_setzero_ps(), in_order(_mm_mul_ps(_mm_set1_ps(half_of(p + 2)), mn4))));
}

template <int64_t Format>
__attribute__((always_inline)) inline void unpack_quad(const uint8_t* row, int64_t b, Quad& out) {
  if constexpr (Format == kFormatQ4_0 || Format == kFormatQ5_0 || Format == kFormatQ5_1) {
    float d[4], m[4] = {0.f, 0.f, 0.f, 0.f};
    const __m256i bias = _mm256_set1_epi16(Format == kFormatQ4_0 ? 8 : Format == kFormatQ5_0 ? 16 : 0);
    for (int64_t i = 0; i < 4; ++i) {
      const uint8_t* p = row + (b + i) * stored_bytes(Format);
      d[i] = half_of(p);
      const __m128i qs = load16(p + (Format == kFormatQ4_0 ? 2 : Format == kFormatQ5_0 ? 6 : 8));
      __m256i lo = nibbles_low(qs), hi = nibbles_high(qs);
      if constexpr (Format != kFormatQ4_0) {
        const uint32_t qh = u32_at(p + (Format == kFormatQ5_0 ? 2 : 4));
        lo = _mm256_or_si256(lo, fifth_bits(qh & 0xFFFF));
        hi = _mm256_or_si256(hi, fifth_bits(qh >> 16));
      }
      if constexpr (Format == kFormatQ5_1) m[i] = half_of(p + 2);
      out.lo[i] = _mm256_sub_epi16(lo, bias);
      out.hi[i] = _mm256_sub_epi16(hi, bias);
    }
    out.d = _mm_loadu_ps(d);
    out.m = _mm_loadu_ps(m);
  } else if constexpr (Format == kFormatQ4_K || Format == kFormatQ5_K) {
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t first = b % 8;  // 0 or 4
    k_quad_scales(p, first, out.d, out.m);
    const uint8_t* qs = p + (Format == kFormatQ4_K ? 16 : 48) + (first / 2) * 32;
    __m256i high_lo, high_hi;
    if constexpr (Format == kFormatQ5_K) {
      high_lo = _mm256_cvtepu8_epi16(load16(p + 16));
      high_hi = _mm256_cvtepu8_epi16(load16(p + 32));
    }
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t j = first + i;
      const __m128i a = load16(qs + (i / 2) * 32), c = load16(qs + (i / 2) * 32 + 16);
      __m256i lo = i % 2 ? nibbles_high(a) : nibbles_low(a), hi = i % 2 ? nibbles_high(c) : nibbles_low(c);
      if constexpr (Format == kFormatQ5_K) {
        const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(j));
        const __m256i one = _mm256_set1_epi16(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high_lo, shift), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high_hi, shift), one), 4));
      }
      out.lo[i] = lo;
      out.hi[i] = hi;
    }
  } else if constexpr (Format == kFormatQ6_K) {
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t h = (b % 8) / 4;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    out.d = _mm_set1_ps(half_of(p + 208));
    out.m = _mm_setzero_ps();
    const __m256i qh_lo = _mm256_cvtepu8_epi16(load16(p + 128 + h * 32)), qh_hi = _mm256_cvtepu8_epi16(load16(p + 128 + h * 32 + 16));
    const __m256i three = _mm256_set1_epi16(3), thirty_two = _mm256_set1_epi16(32);
    for (int64_t i = 0; i < 4; ++i) {  // sub-block r = 4h + i: k = i / 2, j = i % 2
      const int64_t k = i / 2, j = i % 2, r = 4 * h + i;
      const __m128i a = load16(p + h * 64 + j * 32), c = load16(p + h * 64 + j * 32 + 16);
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(2 * (2 * k + j)));
      const __m256i lo = _mm256_or_si256(k ? nibbles_high(a) : nibbles_low(a),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh_lo, shift), three), 4));
      const __m256i hi = _mm256_or_si256(k ? nibbles_high(c) : nibbles_low(c),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh_hi, shift), three), 4));
      out.lo[i] = _mm256_mullo_epi16(_mm256_sub_epi16(lo, thirty_two), _mm256_set1_epi16(sc[2 * r]));
      out.hi[i] = _mm256_mullo_epi16(_mm256_sub_epi16(hi, thirty_two), _mm256_set1_epi16(sc[2 * r + 1]));
    }
  } else {  // IQ4_XS
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t first = b % 8;
    uint16_t scales_h;
    std::memcpy(&scales_h, p + 2, 2);
    // the four sub-blocks' 6-bit scales as bytes of one word (an array would be stored, then loaded
    // whole: a stall as long as the rest of the quad's work)
    const uint32_t low = p[4 + first / 2] | (p[5 + first / 2] << 8), high = scales_h >> (2 * first);
    uint32_t packed = 0;
    for (int64_t i = 0; i < 4; ++i) packed |= (((low >> (4 * i)) & 0x0F) | (((high >> (2 * i)) & 3) << 4)) << (8 * i);
    const __m128i ls = _mm_sub_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(packed))), _mm_set1_epi32(32));
    out.d = in_order(_mm_mul_ps(_mm_set1_ps(half_of(p)), _mm_cvtepi32_ps(ls)));
    out.m = _mm_setzero_ps();
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Table)), mask = _mm_set1_epi8(0x0F);
    for (int64_t i = 0; i < 4; ++i) {
      const __m128i qs = load16(p + 8 + (first + i) * 16);
      out.lo[i] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(qs, mask)));
      out.hi[i] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), mask)));
    }
  }
}

inline __m256i block_dot(__m256i lo, __m256i hi, const int16_t* xb) {
  return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
                          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
}

inline float hsum_ps(__m128 v) {
  v = in_order(_mm_add_ps(in_order(v), _mm_movehl_ps(v, v)));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return in_order(_mm_cvtss_f32(v));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Blocks [b, nb) of a row (its last, short of a group of four) widened one at a time: each block's
// scaled integer dot product added to tail[i], its offset term to offsets[i].
template <int64_t Format, int64_t MB>
__attribute__((always_inline)) inline void widened_tail(const uint8_t* row, int64_t b, int64_t nb,
                                                        const int16_t* const* xq, const float* const* xd,
                                                        const float* const* xs, float* tail, float* offsets) {
  for (; b < nb; ++b) {
    alignas(32) int16_t q[kBlock];
    float dw, mw;
    unpack_block<Format>(row, b, q, dw, mw);
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(q)),
                  hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 16));
    for (int64_t i = 0; i < MB; ++i) {
      const int32_t dot = hsum_epi32(block_dot(lo, hi, xq[i] + b * kBlock));
      tail[i] = in_order(std::fma(in_order(dw * xd[i][b]), static_cast<float>(dot), tail[i]));
      offsets[i] = in_order(std::fma(mw, xs[i][b], offsets[i]));
    }
  }
}
#endif

#if defined(CBSERVE_BYTE_PRODUCTS)
// The byte form (kernels.h's quad_dot, as block_quant_linear.cpp runs Q4_1): four blocks' weights as
// unsigned bytes, one block per 128-bit lane (lo: weights 0-15, hi: 16-31), with w = d * q + m. The
// formats whose q are signed take m = -8 d (Q4_0) or -16 d (Q5_0); a fifth bit is added to its
// bytes under a mask. Q4_K and Q5_K keep 32 nibbles of a sub-block in the low (even sub-block) or
// high (odd) halves of 32 bytes: the low and high nibbles of 64 bytes are four sub-blocks' weights,
// whose 128-bit lanes a permute puts in block order. Against the widened form on the same CPU (one
// thread, 8192 x 2048 weights, one token): Q4_0 1.37x, Q5_0 1.8x, Q5_1 1.55x, Q4_K 1.16x, Q5_K 1.55x.
struct ByteQuad {
  __m512i lo, hi;
  __m128 d, m;
};

inline __m512i four_lanes(const uint8_t* a, const uint8_t* b, const uint8_t* c, const uint8_t* d) {
  const __m512i ab = _mm512_inserti32x4(_mm512_castsi128_si512(load16(a)), load16(b), 1);
  return _mm512_inserti32x4(_mm512_inserti32x4(ab, load16(c), 2), load16(d), 3);
}

template <int64_t Format>
__attribute__((always_inline)) inline void unpack_bytes(const uint8_t* row, int64_t b, ByteQuad& out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  if constexpr (Format == kFormatQ4_0 || Format == kFormatQ5_0 || Format == kFormatQ5_1) {
    constexpr int64_t kQs = Format == kFormatQ4_0 ? 2 : Format == kFormatQ5_0 ? 6 : 8;
    const uint8_t* p[4];
    float d[4], m[4];
    uint64_t fifth_lo = 0, fifth_hi = 0;  // weight j's fifth bit, 16 bits a block
    for (int64_t i = 0; i < 4; ++i) {
      p[i] = row + (b + i) * stored_bytes(Format);
      d[i] = half_of(p[i]);
      m[i] = Format == kFormatQ5_1 ? half_of(p[i] + 2) : (Format == kFormatQ4_0 ? -8.f : -16.f) * d[i];
      if constexpr (Format != kFormatQ4_0) {
        const uint64_t qh = u32_at(p[i] + (Format == kFormatQ5_0 ? 2 : 4));
        fifth_lo |= (qh & 0xFFFF) << (16 * i);
        fifth_hi |= (qh >> 16) << (16 * i);
      }
    }
    const __m512i bytes = four_lanes(p[0] + kQs, p[1] + kQs, p[2] + kQs, p[3] + kQs);
    out.lo = _mm512_and_si512(bytes, nibble);
    out.hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    if constexpr (Format != kFormatQ4_0) {
      out.lo = _mm512_mask_add_epi8(out.lo, fifth_lo, out.lo, sixteen);
      out.hi = _mm512_mask_add_epi8(out.hi, fifth_hi, out.hi, sixteen);
    }
    out.d = _mm_loadu_ps(d);
    out.m = _mm_loadu_ps(m);
  } else {  // Q4_K, Q5_K
    const uint8_t* p = row + (b / 8) * stored_bytes(Format);
    const int64_t first = b % 8;  // 0 or 4
    k_quad_scales(p, first, out.d, out.m);
    const __m512i bytes = _mm512_loadu_si512(p + (Format == kFormatQ4_K ? 16 : 48) + (first / 2) * 32);
    const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    // lanes of bytes: sub-blocks (first, first + 1) weights 0-15 and 16-31, then (first + 2, first + 3)
    out.lo = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high);
    out.hi = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), high);
    if constexpr (Format == kFormatQ5_K) {  // sub-block j's fifth bits: bit j of qh[0:16] (lo), qh[16:32] (hi)
      const uint32_t bit = 0x01010101u << first;
      const int32_t b0 = static_cast<int32_t>(bit), b1 = static_cast<int32_t>(bit << 1),
                    b2 = static_cast<int32_t>(bit << 2), b3 = static_cast<int32_t>(bit << 3);
      const __m512i which = _mm512_setr_epi32(b0, b0, b0, b0, b1, b1, b1, b1, b2, b2, b2, b2, b3, b3, b3, b3);
      const __mmask64 lo = _mm512_test_epi8_mask(_mm512_broadcast_i32x4(load16(p + 16)), which);
      const __mmask64 hi = _mm512_test_epi8_mask(_mm512_broadcast_i32x4(load16(p + 32)), which);
      out.lo = _mm512_mask_add_epi8(out.lo, lo, out.lo, sixteen);
      out.hi = _mm512_mask_add_epi8(out.hi, hi, out.hi, sixteen);
    }
  }
}

// dot_rows in the byte form: whole groups of four blocks as bytes, the last nb % 4 blocks (Q4_0, Q5_0,
// Q5_1 rows of other lengths) widened.
template <int64_t Format, int64_t MB>
void dot_rows_bytes(const uint8_t* row, int64_t nb, const QuantizedX& qx, const int8_t* xb_rows, int64_t m0,
                    float* sums) {
  const int8_t* xb[MB];
  const int16_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int64_t i = 0; i < MB; ++i) {
    xb[i] = xb_rows + (m0 + i) * qx.nbp / kQuantizedXGroup * kQuadBytes;
    xq[i] = qx.q.get() + (m0 + i) * nb * kBlock;
    xd[i] = qx.d.get() + (m0 + i) * qx.nbp;
    xs[i] = qx.s.get() + (m0 + i) * qx.nbp;
  }
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // block of each lane
  __m512 acc[MB];
  __m128 offset_acc[MB];
  float tail[MB] = {}, offsets[MB] = {};
  for (int64_t i = 0; i < MB; ++i) {
    acc[i] = _mm512_setzero_ps();
    offset_acc[i] = _mm_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    prefetch_quad<Format>(row, b);
    ByteQuad quad;
    unpack_bytes<Format>(row, b, quad);
    for (int64_t i = 0; i < MB; ++i) {
      const __m128 scales = in_order(_mm_mul_ps(quad.d, _mm_loadu_ps(xd[i] + b)));
      acc[i] = _mm512_fmadd_ps(quad_dot(quad.lo, quad.hi, xb[i] + b / 4 * kQuadBytes),
                               _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales)), acc[i]);
      offset_acc[i] = _mm_fmadd_ps(quad.m, _mm_loadu_ps(xs[i] + b), offset_acc[i]);
    }
  }
  widened_tail<Format, MB>(row, b, nb, xq, xd, xs, tail, offsets);
  for (int64_t i = 0; i < MB; ++i)
    sums[i] = in_order(in_order(in_order(_mm512_reduce_add_ps(acc[i])) + tail[i]) +
                       in_order(hsum_ps(offset_acc[i]) + offsets[i]));
}

template <int64_t Format>
void dot_pass_bytes(const uint8_t* row, int64_t nb, const QuantizedX& qx, const int8_t* xb, int64_t m0, int64_t mb,
                    float* sums) {
  switch (mb) {
    case 1: dot_rows_bytes<Format, 1>(row, nb, qx, xb, m0, sums); break;
    case 2: dot_rows_bytes<Format, 2>(row, nb, qx, xb, m0, sums); break;
    case 3: dot_rows_bytes<Format, 3>(row, nb, qx, xb, m0, sums); break;
    default: dot_rows_bytes<Format, 4>(row, nb, qx, xb, m0, sums); break;
  }
}
#endif

// sums[i] = the weight row . row m0 + i of x, for i < MB; each row's arithmetic is the same whatever MB is.
template <int64_t Format, int64_t MB>
void dot_rows(const uint8_t* row, int64_t nb, const QuantizedX& qx, int64_t m0, float* sums) {
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
  for (; b + 4 <= nb; b += 4) {
    prefetch_quad<Format>(row, b);
    Quad quad;
    unpack_quad<Format>(row, b, quad);
    for (int64_t i = 0; i < MB; ++i) {
      const int16_t* x = xq[i] + b * kBlock;
      const __m256i first = _mm256_hadd_epi32(block_dot(quad.lo[0], quad.hi[0], x), block_dot(quad.lo[1], quad.hi[1], x + kBlock));
      const __m256i second = _mm256_hadd_epi32(block_dot(quad.lo[2], quad.hi[2], x + 2 * kBlock),
                                               block_dot(quad.lo[3], quad.hi[3], x + 3 * kBlock));
      const __m256i four = _mm256_hadd_epi32(first, second);  // lanes: blocks b..b+3, per half
      const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(four), _mm256_extracti128_si256(four, 1));
      acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), in_order(_mm_mul_ps(quad.d, _mm_loadu_ps(xd[i] + b))), acc[i]);
      offset_acc[i] = _mm_fmadd_ps(quad.m, _mm_loadu_ps(xs[i] + b), offset_acc[i]);
    }
  }
  widened_tail<Format, MB>(row, b, nb, xq, xd, xs, tail, offsets);
  for (int64_t i = 0; i < MB; ++i)
    sums[i] = in_order(in_order(hsum_ps(acc[i]) + tail[i]) + in_order(hsum_ps(offset_acc[i]) + offsets[i]));
#else
  for (; b < nb; ++b) {
    int16_t q[kBlock];
    float dw, mw;
    unpack_block<Format>(row, b, q, dw, mw);
    for (int64_t i = 0; i < MB; ++i) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(q[j]) * xq[i][b * kBlock + j];
      tail[i] = in_order(std::fma(in_order(dw * xd[i][b]), static_cast<float>(dot), tail[i]));
      offsets[i] = in_order(std::fma(mw, xs[i][b], offsets[i]));
    }
  }
  for (int64_t i = 0; i < MB; ++i) sums[i] = in_order(tail[i] + offsets[i]);
#endif
}

template <int64_t Format>
void dot_pass(const uint8_t* row, int64_t nb, const QuantizedX& qx, int64_t m0, int64_t mb, float* sums) {
  switch (mb) {
    case 1: dot_rows<Format, 1>(row, nb, qx, m0, sums); break;
    case 2: dot_rows<Format, 2>(row, nb, qx, m0, sums); break;
    case 3: dot_rows<Format, 3>(row, nb, qx, m0, sums); break;
    default: dot_rows<Format, 4>(row, nb, qx, m0, sums); break;
  }
}

}  // namespace

void unpack_row(int64_t format, const uint8_t* row, int64_t nb, int16_t* q, float* d, float* m) {
  if (format == kFormatQ8_0 || format == kFormatQ8_0Bf16 || format == kFormatQ4_1) {
    const bool q8 = format != kFormatQ4_1;  // Q8_0: q[K] int8 then d[nb]; Q4_1: nibbles[K / 2], d[nb], m[nb]
    const uint8_t* ds = row + nb * (q8 ? kBlock : kBlock / 2);
    for (int64_t b = 0; b < nb; ++b) {
      d[b] = half_of(ds + 2 * b);
      m[b] = q8 ? 0.f : half_of(ds + 2 * nb + 2 * b);
      for (int64_t j = 0; j < 16 && !q8; ++j) {
        q[b * kBlock + j] = row[b * 16 + j] & 0x0F;
        q[b * kBlock + j + 16] = row[b * 16 + j] >> 4;
      }
      for (int64_t j = 0; j < kBlock && q8; ++j) q[b * kBlock + j] = static_cast<int8_t>(row[b * kBlock + j]);
    }
    return;
  }
  switch (format) {
    case kFormatQ4_0: return unpack_blocks<kFormatQ4_0>(row, nb, q, d, m);
    case kFormatQ5_0: return unpack_blocks<kFormatQ5_0>(row, nb, q, d, m);
    case kFormatQ5_1: return unpack_blocks<kFormatQ5_1>(row, nb, q, d, m);
    case kFormatQ4_K: return unpack_blocks<kFormatQ4_K>(row, nb, q, d, m);
    case kFormatQ5_K: return unpack_blocks<kFormatQ5_K>(row, nb, q, d, m);
    case kFormatQ6_K: return unpack_blocks<kFormatQ6_K>(row, nb, q, d, m);
    default: return unpack_blocks<kFormatIQ4_XS>(row, nb, q, d, m);
  }
}

int64_t stored_row_bytes(int64_t format, int64_t K) {
  return K / stored_weights(format) * stored_bytes(format);
}

int64_t stored_row_columns(int64_t format, int64_t row_bytes) {
  return row_bytes / stored_bytes(format) * stored_weights(format);
}

#if defined(CBSERVE_BYTE_PRODUCTS)
bool stored_byte_form(int64_t format) {
  return format == kFormatQ4_0 || format == kFormatQ5_0 || format == kFormatQ5_1 || format == kFormatQ4_K ||
         format == kFormatQ5_K;
}
#endif

void stored_dot_pass(const uint8_t* row, int64_t format, int64_t nb, const QuantizedX& qx,
                     [[maybe_unused]] const int8_t* xb, int64_t m0, int64_t mb, float* sums) {
#if defined(CBSERVE_BYTE_PRODUCTS)
  if (xb != nullptr) {
    switch (format) {
      case kFormatQ4_0: return dot_pass_bytes<kFormatQ4_0>(row, nb, qx, xb, m0, mb, sums);
      case kFormatQ5_0: return dot_pass_bytes<kFormatQ5_0>(row, nb, qx, xb, m0, mb, sums);
      case kFormatQ5_1: return dot_pass_bytes<kFormatQ5_1>(row, nb, qx, xb, m0, mb, sums);
      case kFormatQ4_K: return dot_pass_bytes<kFormatQ4_K>(row, nb, qx, xb, m0, mb, sums);
      case kFormatQ5_K: return dot_pass_bytes<kFormatQ5_K>(row, nb, qx, xb, m0, mb, sums);
      default: break;
    }
  }
#endif
  switch (format) {
    case kFormatQ4_0: dot_pass<kFormatQ4_0>(row, nb, qx, m0, mb, sums); break;
    case kFormatQ5_0: dot_pass<kFormatQ5_0>(row, nb, qx, m0, mb, sums); break;
    case kFormatQ5_1: dot_pass<kFormatQ5_1>(row, nb, qx, m0, mb, sums); break;
    case kFormatQ4_K: dot_pass<kFormatQ4_K>(row, nb, qx, m0, mb, sums); break;
    case kFormatQ5_K: dot_pass<kFormatQ5_K>(row, nb, qx, m0, mb, sums); break;
    case kFormatQ6_K: dot_pass<kFormatQ6_K>(row, nb, qx, m0, mb, sums); break;
    default: dot_pass<kFormatIQ4_XS>(row, nb, qx, m0, mb, sums); break;
  }
}
