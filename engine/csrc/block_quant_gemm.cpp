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
// Tile order of the weights (engine/models/linear.py packs it, bf16): for each 16 output columns
// and each block, 16 rows of 64 bytes, row r holding each column's weights 2r and 2r + 1:
// TDPBF16PS's B operand, one tile load per block and column group.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
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
// The tile registers in use: two fp32 sum tiles (even and odd blocks, so one block's tile products
// overlap the previous block's scaling), x's halves, the weights. Macros: GCC's tile intrinsics
// take the register number as a literal.
#define TILE_SUM_EVEN 0
#define TILE_SUM_ODD 1
#define TILE_XHI 2
#define TILE_XLO 3
#define TILE_W 4

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig config;
  for (int t = TILE_SUM_EVEN; t <= TILE_W; ++t) config.rows[t] = kTileRows, config.colsb[t] = 64;
  return config;
}

// Linux hands a process the tile state only on request.
bool request_tiles() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x's quantized rows as bf16 halves 128 * hi and lo, padded with zero rows to whole tiles, in tile
// order (row tile, block, 16 rows, 32 values): a tile load reads 1 KiB in a row.
struct SplitX {
  std::vector<uint16_t> hi, lo;
  std::vector<float> d, s;  // (padded M, nb)
};

inline int64_t tile_offset(int64_t m, int64_t k, int64_t nb) {
  return ((m / kTileRows * nb + k / kBlock) * kTileRows + m % kTileRows) * kBlock + k % kBlock;
}

// Small integers as bf16: exact, so the top half of their fp32 bits.
inline __m256i as_bf16(__m512i ints) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(ints)), 16)); }

SplitX split(const QuantizedX& qx, int64_t M, int64_t Mp, int64_t K) {
  const int64_t nb = K / kBlock;
  SplitX out{std::vector<uint16_t>(Mp * K), std::vector<uint16_t>(Mp * K), std::vector<float>(Mp * nb),
             std::vector<float>(Mp * nb)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; k += 16) {
        const __m512i q = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q.data() + m * K + k)));
        const __m512i hi = _mm512_slli_epi32(_mm512_srai_epi32(q, 7), 7);  // 128 * floor(q / 128)
        const int64_t at = tile_offset(m, k, nb);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.hi.data() + at), as_bf16(hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.lo.data() + at), as_bf16(_mm512_sub_epi32(q, hi)));
      }
      std::copy_n(qx.d.data() + m * qx.nbp, nb, out.d.data() + m * nb);
      std::copy_n(qx.s.data() + m * qx.nbp, nb, out.s.data() + m * nb);
    }
  });
  return out;
}

// Block b's sums for 16 rows of x (from m0) and the 16 columns of group g, into tile Sum.
#define BLOCK_SUMS(Sum, b)                                                              \
  _tile_zero(Sum);                                                                      \
  _tile_loadd(TILE_XHI, x.hi.data() + tile_offset(m0, (b) * kBlock, nb), 64);          \
  _tile_loadd(TILE_XLO, x.lo.data() + tile_offset(m0, (b) * kBlock, nb), 64);          \
  _tile_loadd(TILE_W, tiles + (g * nb + (b)) * kTileElements, 64);                      \
  _tile_dpbf16ps(Sum, TILE_XHI, TILE_W);                                                \
  _tile_dpbf16ps(Sum, TILE_XLO, TILE_W)

// acc (16 rows) += block b's sums times d_w * d_x, plus m_w * s_x (Q4_1).
template <bool Offsets>
__attribute__((always_inline)) inline void scale_block(const SplitX& x, int64_t nb, int64_t m0, int64_t b,
                                                       const float* sums, const float* scales, const float* offsets,
                                                       int64_t N, int64_t n0, __m512* acc) {
  const __m512 dw = _mm512_loadu_ps(scales + b * N + n0);
  __m512 mw;
  if constexpr (Offsets) mw = _mm512_loadu_ps(offsets + b * N + n0);
#pragma GCC unroll 16
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int64_t row = (m0 + r) * nb + b;
    acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(sums + r * 16), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[row])), acc[r]);
    if constexpr (Offsets) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[row]), acc[r]);
  }
}

// out (16 rows from m0, the 16 columns of group g) = residual + (x's rows times the weights + bias).
template <bool Offsets>
void tile_pass(const SplitX& x, int64_t M, int64_t K, int64_t m0, const uint16_t* tiles, const float* scales,
               const float* offsets, const float* bias, const float* residual, int64_t N, int64_t g, float* out) {
  const int64_t nb = K / kBlock, n0 = g * 16;
  alignas(64) float even[kTileRows * 16], odd[kTileRows * 16];
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    BLOCK_SUMS(TILE_SUM_EVEN, b);
    BLOCK_SUMS(TILE_SUM_ODD, b + 1);
    _tile_stored(TILE_SUM_EVEN, even, 64);
    _tile_stored(TILE_SUM_ODD, odd, 64);
    scale_block<Offsets>(x, nb, m0, b, even, scales, offsets, N, n0, acc);
    scale_block<Offsets>(x, nb, m0, b + 1, odd, scales, offsets, N, n0, acc);
  }
  if (b < nb) {
    BLOCK_SUMS(TILE_SUM_EVEN, b);
    _tile_stored(TILE_SUM_EVEN, even, 64);
    scale_block<Offsets>(x, nb, m0, b, even, scales, offsets, N, n0, acc);
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < kTileRows && m0 + r < M; ++r) {
    const int64_t at = (m0 + r) * N + n0;
    const __m512 sum = _mm512_add_ps(acc[r], bv);
    _mm512_storeu_ps(out + at, residual ? _mm512_add_ps(_mm512_loadu_ps(residual + at), sum) : sum);
  }
}
#undef BLOCK_SUMS
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
                               const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(block_quant_gemm_available(), "block_quant_gemm needs AMX bf16 tiles, which this CPU or build lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x: contiguous fp32 (M, K), K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(1) == nb && tiles.size(2) == kTileElements, "tiles: contiguous bf16 (N / 16, K / 32, 512)");
  const int64_t groups = tiles.size(0), N = groups * 16;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(0) == nb &&
                  scales.size(1) == N, "scales: contiguous fp32 (K / 32, N)");
  TORCH_CHECK(!offsets.has_value() || (offsets->scalar_type() == torch::kFloat && offsets->is_contiguous() &&
                  offsets->sizes() == scales.sizes()), "offsets: contiguous fp32 (K / 32, N)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->numel() == N), "bias: fp32 (N)");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == torch::kFloat && residual->is_contiguous() &&
                  residual->size(0) == M && residual->size(1) == N), "residual: contiguous fp32 (M, N)");
  auto out = torch::empty({M, N}, x.options());
#if defined(CBSERVE_AMX)
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows, row_tiles = Mp / kTileRows;
  const SplitX split_x = split(quantize_x(x.data_ptr<float>(), M, K), M, Mp, K);
  const uint16_t* tp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const float* sp = scales.data_ptr<float>();
  const float* mp = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Work items: (chunk of kChunkTiles row tiles, column group, row tile in the chunk), so a chunk of
  // x stays in the cache while every column group's weights pass, and each group's weights serve
  // the chunk's row tiles one after another.
  constexpr int64_t kChunkTiles = 4;
  const int64_t chunks = (row_tiles + kChunkTiles - 1) / kChunkTiles;
  at::parallel_for(0, chunks * groups * kChunkTiles, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / (groups * kChunkTiles), g = item / kChunkTiles % groups;
      const int64_t row_tile = chunk * kChunkTiles + item % kChunkTiles, m0 = row_tile * kTileRows;
      if (row_tile >= row_tiles) continue;  // the last chunk's missing tiles
      if (mp) {
        tile_pass<true>(split_x, M, K, m0, tp, sp, mp, bp, rp, N, g, op);
      } else {
        tile_pass<false>(split_x, M, K, m0, tp, sp, mp, bp, rp, N, g, op);
      }
    }
    _tile_release();
  });
#endif
  return out;
}
