// Matmul on GGUF block-quantized weights for large batches (prefill chunks, decode batches past the
// decode kernel's rows) on AMX tiles, where the CPU has them (Intel Sapphire Rapids and later). The
// arithmetic is block_quant_linear's: activations quantized per block of 32 to 15 bits, each block's
// dot product of integers, scaled by the weight block's d times the activation block's d, plus
// Q4_1's offset m times the activation block's scaled sum. So a row's output is the decode
// kernel's to fp32 rounding, and the same bits whatever the batch.
//
// No library computes this: oneDNN's and fbgemm's int8 GEMMs take one weight scale per output
// channel and 8-bit activations, which cost SmolLM2-135M the quality bar (BENCHMARKS.md). The
// scales change every 32 weights, so each block's sums leave the tiles before the next block.
// The integers ride in bf16, where they are exact: a 15-bit activation q is split as
// q = 128 * hi + lo (hi in [-127, 127], lo in [0, 127]), and 128 * hi, lo and the weights
// (Q8_0 -127..127, Q4_1 0..15) are all bf16 values; TDPBF16PS multiplies them exactly and sums
// both halves of a block into one fp32 tile, so a block costs one tile store and one vector
// multiply-add per row (int8 tiles would need two stores, a shift and a conversion per row).
// Sums past 2^24 round as fp32 does.
//
// The `int8` mode's Q8_0 blocks have scales of at most 8 significant bits, so each weight d * q
// (15 bits) is the sum of two bf16 values, hi and lo, and its activations are rounded to bf16:
// bf16_tile_gemm then multiplies exact products with no scale inside K, and its tiles sum all
// of K before one store (Bf16Pass): the per-block store and scaling above, which bound TilePass,
// are gone, for two tile products a block instead of one per half.
//
// Tile order of the weights (engine/models/linear.py packs it, bf16): for each 16 output columns
// and each block, 16 rows of 64 bytes, row r holding each column's weights 2r and 2r + 1:
// TDPBF16PS's B operand, one tile load per block and column group.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <memory>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CBSERVE_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;  // rows of x per tile, and output columns per weight tile
constexpr int64_t kTileElements = kBlock * 16;  // one block of 16 columns in tile order (bf16)

#if defined(CBSERVE_AMX)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = kTileRows, config.colsb[t] = 64;
  return config;
}

// Linux hands a process the tile state only on request.
bool request_tiles() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x's quantized rows as bf16 halves 128 * hi and lo, padded with zero rows to whole tiles, in tile
// order (row tile, block, 16 rows, 32 values): a tile load reads 1 KiB in a row. Allocated without
// zeroing (split writes every element): clearing MBs per call costs more than the copy. x rounded
// to bf16 is one half, hi, and carries no scales.
struct SplitX {
  Scratch<uint16_t> hi, lo;
  Scratch<float> d, s;  // (padded M, nb)
};

inline int64_t tile_offset(int64_t m, int64_t k, int64_t nb) {
  return ((m / kTileRows * nb + k / kBlock) * kTileRows + m % kTileRows) * kBlock + k % kBlock;
}

// Small integers as bf16: exact, so the top half of their fp32 bits.
inline __m256i as_bf16(__m512i ints) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(ints)), 16)); }

SplitX split(const QuantizedX& qx, int64_t M, int64_t Mp, int64_t K) {
  const int64_t nb = K / kBlock;
  SplitX out{scratch<uint16_t>(Mp * K), scratch<uint16_t>(Mp * K),
             scratch<float>(Mp * nb), scratch<float>(Mp * nb)};
  at::parallel_for(0, Mp, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (m >= M) {  // padding: zero rows
        for (int64_t k = 0; k < K; k += 16) {
          const int64_t at = tile_offset(m, k, nb);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.hi.get() + at), _mm256_setzero_si256());
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.lo.get() + at), _mm256_setzero_si256());
        }
        std::fill_n(out.d.get() + m * nb, nb, 0.0f);
        std::fill_n(out.s.get() + m * nb, nb, 0.0f);
        continue;
      }
      for (int64_t k = 0; k < K; k += 16) {
        const __m512i q = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q.get() + m * K + k)));
        const __m512i hi = _mm512_slli_epi32(_mm512_srai_epi32(q, 7), 7);  // 128 * floor(q / 128)
        const int64_t at = tile_offset(m, k, nb);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.hi.get() + at), as_bf16(hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.lo.get() + at), as_bf16(_mm512_sub_epi32(q, hi)));
      }
      std::copy_n(qx.d.get() + m * qx.nbp, nb, out.d.get() + m * nb);
      std::copy_n(qx.s.get() + m * qx.nbp, nb, out.s.get() + m * nb);
    }
  });
  return out;
}

// out (a pass's rows < M, its CG column groups from n0) = residual + (the pass's sums, RT * CG tiles
// of 16 x 16, + bias).
template <int RT, int CG>
void write_out(const float (*sums)[kTileRows * 16], int64_t M, int64_t m0, int64_t N, int64_t n0, const float* bias,
               const float* residual, float* out) {
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CG; ++c) {
      const __m512 bv = bias ? _mm512_loadu_ps(bias + n0 + c * 16) : _mm512_setzero_ps();
      for (int64_t i = 0; i < kTileRows && m0 + r * kTileRows + i < M; ++i) {
        const int64_t at = (m0 + r * kTileRows + i) * N + n0 + c * 16;
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums[r * CG + c] + i * 16), bv);
        _mm512_storeu_ps(out + at, residual ? _mm512_add_ps(_mm512_loadu_ps(residual + at), sum) : sum);
      }
    }
  }
}

// Runs Pass<RT, CG>().run(args...) for a pass of 1 or 2 row tiles and 1 or 2 column groups.
template <template <int, int> class Pass, class... Args>
void run_pass(int row_tiles, int groups, const Args&... args) {
  if (row_tiles == 2 && groups == 2) {
    Pass<2, 2>().run(args...);
  } else if (row_tiles == 2) {
    Pass<2, 1>().run(args...);
  } else if (groups == 2) {
    Pass<1, 2>().run(args...);
  } else {
    Pass<1, 1>().run(args...);
  }
}

// One pass computes RT row tiles (16 rows each, from m0) times CG column groups (16 columns each,
// from group g) over all blocks: per block, RT * CG sum tiles from RT x tiles (each loaded once per
// half, so it serves CG groups) and CG weight tiles (each serving RT row tiles), stored, then
// scaled into accumulators in L1. The previous block's scaling runs after this block's tile
// products are issued, so the vector units work while the tiles do.
template <bool Offsets, bool Halves, int RT, int CG>
struct TilePass {
  static constexpr int kSums = RT * CG;
  alignas(64) float sums[2][kSums][kTileRows * 16];  // two blocks' stored sums: this one, the last
  alignas(64) float acc[kSums][kTileRows * 16];

  // Tile registers: sums (r, c) in r * 2 + c (0-3), x row tile r in 4 + r, weights c in 6 + c.
  static void load_x(const uint16_t* half, int64_t m0, int64_t b, int64_t nb) {
    _tile_loadd(4, half + tile_offset(m0, b * kBlock, nb), 64);
    if constexpr (RT == 2) _tile_loadd(5, half + tile_offset(m0 + kTileRows, b * kBlock, nb), 64);
  }
  static void products() {
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CG == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && CG == 2) _tile_dpbf16ps(3, 5, 7);
  }
  // `next`: the next column groups' weights (1 or 2 groups), whose block b is prefetched into L2 while
  // this block's tiles are computed; nullptr when another pass brings them.
  void block_sums(const SplitX& x, const uint16_t* tiles, int64_t nb, int64_t m0, int64_t g, int64_t b,
                  const uint16_t* next, int next_groups) {
    for (int c = 0; next && c < next_groups; ++c) {
      const char* tile = reinterpret_cast<const char*>(next + (c * nb + b) * kTileElements);
#pragma GCC unroll 16
      for (int line = 0; line < 16; ++line) _mm_prefetch(tile + 64 * line, _MM_HINT_T1);
    }
    _tile_zero(0);
    if constexpr (CG == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && CG == 2) _tile_zero(3);
    _tile_loadd(6, tiles + (g * nb + b) * kTileElements, 64);
    if constexpr (CG == 2) _tile_loadd(7, tiles + ((g + 1) * nb + b) * kTileElements, 64);
    load_x(x.hi.get(), m0, b, nb);
    products();
    if constexpr (Halves) {
      load_x(x.lo.get(), m0, b, nb);
      products();
    }
    float(*out)[kTileRows * 16] = sums[b & 1];
    _tile_stored(0, out[0], 64);
    if constexpr (CG == 2) _tile_stored(1, out[1], 64);
    if constexpr (RT == 2) _tile_stored(2, out[CG], 64);
    if constexpr (RT == 2 && CG == 2) _tile_stored(3, out[3], 64);
  }
  // acc += block b's sums times d_w * d_x, plus m_w * s_x (Q4_1).
  void scale(const SplitX& x, int64_t nb, int64_t m0, int64_t b, const float* scales, const float* offsets,
             int64_t N, int64_t n0) {
    for (int r = 0; r < RT; ++r) {
      for (int c = 0; c < CG; ++c) {
        const float* block = sums[b & 1][r * CG + c];
        float* a = acc[r * CG + c];
        const __m512 dw = _mm512_loadu_ps(scales + b * N + n0 + c * 16);
        __m512 mw;
        if constexpr (Offsets) mw = _mm512_loadu_ps(offsets + b * N + n0 + c * 16);
#pragma GCC unroll 16
        for (int64_t i = 0; i < kTileRows; ++i) {
          const int64_t row = (m0 + r * kTileRows + i) * nb + b;
          const __m512 d = Halves ? _mm512_mul_ps(dw, _mm512_set1_ps(x.d[row])) : dw;  // bf16 x: unscaled
          __m512 v = _mm512_fmadd_ps(_mm512_load_ps(block + i * 16), d,
                                     _mm512_load_ps(a + i * 16));
          if constexpr (Offsets) v = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[row]), v);
          _mm512_store_ps(a + i * 16, v);
        }
      }
    }
  }
  // out (the pass's rows < M and columns) = residual + (x's rows times the weights + bias).
  void run(const SplitX& x, int64_t M, int64_t K, int64_t m0, const uint16_t* tiles, const float* scales,
           const float* offsets, const float* bias, const float* residual, int64_t N, int64_t g, bool prefetch,
           float* out) {
    const int64_t nb = K / kBlock, n0 = g * 16, groups = N / 16;
    // Weights stream from memory in small batches (each pass's are read once): prefetch the next
    // pass's while this one computes, once per chunk of rows.
    const int next_groups = prefetch ? static_cast<int>(std::clamp<int64_t>(groups - g - CG, 0, 2)) : 0;
    const uint16_t* next = next_groups ? tiles + (g + CG) * nb * kTileElements : nullptr;
    std::fill_n(&acc[0][0], kSums * kTileRows * 16, 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      block_sums(x, tiles, nb, m0, g, b, next, next_groups);
      if (b > 0) scale(x, nb, m0, b - 1, scales, offsets, N, n0);
    }
    scale(x, nb, m0, nb - 1, scales, offsets, N, n0);
    write_out<RT, CG>(acc, M, m0, N, n0, bias, residual, out);
  }
};

// x's rows rounded to bf16, padded with zero rows to whole tiles, in tile order.
Scratch<uint16_t> bf16_rows(const float* x, int64_t M, int64_t Mp, int64_t K) {
  const int64_t nb = K / kBlock;
  Scratch<uint16_t> out = scratch<uint16_t>(Mp * K);
  at::parallel_for(0, Mp, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; k += 16) {
        __m256i bits = _mm256_setzero_si256();
        if (m < M) {  // bf16_bits, 16 at a time
          const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + m * K + k));
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
          bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.get() + tile_offset(m, k, nb)), bits);
      }
    }
  });
  return out;
}

// One pass of bf16_tile_gemm: RT row tiles times CG column groups over all blocks, per block the
// weights' hi tiles then their lo tiles against the same x tiles, summed in the tiles throughout.
template <int RT, int CG>
struct Bf16Pass {
  static constexpr int kSums = RT * CG;
  static constexpr int64_t kBlockElements = 2 * kTileElements;  // hi, lo
  alignas(64) float sums[kSums][kTileRows * 16];

  static void weights(const uint16_t* tiles, int64_t nb, int64_t g, int64_t b, int half) {
    _tile_loadd(6, tiles + (g * nb + b) * kBlockElements + half * kTileElements, 64);
    if constexpr (CG == 2) _tile_loadd(7, tiles + ((g + 1) * nb + b) * kBlockElements + half * kTileElements, 64);
  }
  void run(const uint16_t* x, int64_t M, int64_t K, int64_t m0, const uint16_t* tiles, const float* bias,
           const float* residual, int64_t N, int64_t g, bool prefetch, float* out) {
    const int64_t nb = K / kBlock, n0 = g * 16, groups = N / 16;
    const int next_groups = prefetch ? static_cast<int>(std::clamp<int64_t>(groups - g - CG, 0, 2)) : 0;
    _tile_zero(0);
    if constexpr (CG == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && CG == 2) _tile_zero(3);
    for (int64_t b = 0; b < nb; ++b) {
      for (int c = 0; c < next_groups; ++c) {
        const char* block = reinterpret_cast<const char*>(tiles + ((g + CG + c) * nb + b) * kBlockElements);
#pragma GCC unroll 32
        for (int line = 0; line < 32; ++line) _mm_prefetch(block + 64 * line, _MM_HINT_T1);
      }
      _tile_loadd(4, x + tile_offset(m0, b * kBlock, nb), 64);
      if constexpr (RT == 2) _tile_loadd(5, x + tile_offset(m0 + kTileRows, b * kBlock, nb), 64);
      for (int half = 0; half < 2; ++half) {
        weights(tiles, nb, g, b, half);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (CG == 2) _tile_dpbf16ps(1, 4, 7);
        if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
        if constexpr (RT == 2 && CG == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums[0], 64);
    if constexpr (CG == 2) _tile_stored(1, sums[1], 64);
    if constexpr (RT == 2) _tile_stored(2, sums[CG], 64);
    if constexpr (RT == 2 && CG == 2) _tile_stored(3, sums[3], 64);
    write_out<RT, CG>(sums, M, m0, N, n0, bias, residual, out);
  }
};

// Runs pass(row tiles, column groups, first row, first group, prefetch) over work items (chunk of
// pairs of row tiles, pair of column groups, pair in the chunk), so a chunk of x (about 1 MiB at
// `x_bytes` a value) stays in the cache while every column group's weights pass, and each group
// pair's weights serve the chunk's row tiles one after another.
template <class Pass>
void for_each_pass(int64_t M, int64_t K, int64_t groups, int64_t x_bytes, const Pass& pass) {
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t row_pairs = (row_tiles + 1) / 2, group_pairs = (groups + 1) / 2;
  const int64_t most_pairs = std::max<int64_t>(1, (int64_t(1) << 20) / (2 * kTileRows * K * x_bytes));
  const int64_t chunks = (row_pairs + most_pairs - 1) / most_pairs;
  const int64_t kChunkPairs = (row_pairs + chunks - 1) / chunks;
  at::parallel_for(0, chunks * group_pairs * kChunkPairs, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / (group_pairs * kChunkPairs), gp = item / kChunkPairs % group_pairs;
      const int64_t pair = chunk * kChunkPairs + item % kChunkPairs;
      if (pair >= row_pairs) continue;  // the last chunk's missing pairs
      const int rt = std::min<int64_t>(2, row_tiles - 2 * pair), cg = std::min<int64_t>(2, groups - 2 * gp);
      pass(rt, cg, 2 * pair * kTileRows, 2 * gp, item % kChunkPairs == 0);  // prefetch: the chunk's first pass
    }
    _tile_release();
  });
}

template <bool Offsets, bool Halves>
struct TilePasses {  // TilePass with its first arguments bound, for run_pass
  template <int RT, int CG>
  using Pass = TilePass<Offsets, Halves, RT, CG>;
};

#endif

}  // namespace

bool block_quant_gemm_available() {
#if defined(CBSERVE_AMX)
  static const bool granted = request_tiles();
  return granted;
#else
  return false;
#endif
}

torch::Tensor block_quant_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales,
                               const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& bias,
                               const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                               const c10::optional<torch::Tensor>& residual, bool bf16_activations) {
  TORCH_CHECK(block_quant_gemm_available(), "block_quant_gemm needs AMX bf16 tiles, which this CPU or build lacks");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == kTileElements, "tiles: contiguous bf16 (N / 16, K / 32, 512)");
  const int64_t nb = tiles.size(1), K = nb * kBlock, M = x.size(0);
  check_prologue(x, K, norm_weight, gated);
  const int64_t groups = tiles.size(0), N = groups * 16;
  check_block_scales(scales, offsets, nb, N, bf16_activations);
  check_bias_residual(bias, residual, M, N);
  auto out = torch::empty({M, N}, x.options());
#if defined(CBSERVE_AMX)
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  Scratch<float> transformed;
  const float* rows = with_prologue(x, M, K, norm_weight, eps, gated, transformed);
  SplitX split_x;
  if (bf16_activations) {
    split_x.hi = bf16_rows(rows, M, Mp, K);
  } else {
    split_x = split(quantize_x(rows, M, K), M, Mp, K);
  }
  const uint16_t* tp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const float* sp = scales.data_ptr<float>();
  const float* mp = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  for_each_pass(M, K, groups, bf16_activations ? 2 : 4, [&](int rt, int cg, int64_t m0, int64_t g, bool prefetch) {
    if (mp) {
      run_pass<TilePasses<true, true>::Pass>(rt, cg, split_x, M, K, m0, tp, sp, mp, bp, rp, N, g, prefetch, op);
    } else if (bf16_activations) {
      run_pass<TilePasses<false, false>::Pass>(rt, cg, split_x, M, K, m0, tp, sp, mp, bp, rp, N, g, prefetch, op);
    } else {
      run_pass<TilePasses<false, true>::Pass>(rt, cg, split_x, M, K, m0, tp, sp, mp, bp, rp, N, g, prefetch, op);
    }
  });
#endif
  return out;
}

torch::Tensor bf16_tile_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const c10::optional<torch::Tensor>& bias,
                             const c10::optional<torch::Tensor>& norm_weight, double eps, int64_t gated,
                             const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(block_quant_gemm_available(), "bf16_tile_gemm needs AMX bf16 tiles, which this CPU or build lacks");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == 2 * kTileElements, "tiles: contiguous bf16 (N / 16, K / 32, 2 * 512)");
  const int64_t nb = tiles.size(1), K = nb * kBlock, M = x.size(0), groups = tiles.size(0), N = groups * 16;
  check_prologue(x, K, norm_weight, gated);
  check_bias_residual(bias, residual, M, N);
  auto out = torch::empty({M, N}, x.options());
#if defined(CBSERVE_AMX)
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  Scratch<float> transformed;
  const Scratch<uint16_t> xb = bf16_rows(with_prologue(x, M, K, norm_weight, eps, gated, transformed), M, Mp, K);
  const uint16_t* tp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  for_each_pass(M, K, groups, 2, [&](int rt, int cg, int64_t m0, int64_t g, bool prefetch) {
    run_pass<Bf16Pass>(rt, cg, xb.get(), M, K, m0, tp, bp, rp, N, g, prefetch, op);
  });
#endif
  return out;
}
