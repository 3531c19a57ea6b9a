// Paged decode attention for CPU: one query token per request attends over its KV blocks, read
// in place through the block table (no gather copy). fp32 queries and arithmetic; the cache fp32
// or fp16 (half the bytes a step streams from memory).
//
// Each request's context is cut into chunks of kChunk tokens, and each (request, kv head, chunk)
// is one work item that keeps its partial softmax (max, sum, unnormalised output) for the kv
// head's query heads; a second pass merges the chunks (flash-decoding). So one long request
// spreads over every thread, where parallelism over (request, kv head) alone left a single stream
// with three items for two threads. The chunking depends only on a request's own length, so its
// arithmetic is the same alone or in any batch. A sliding-window layer's query reads only the last
// `window` keys (chunked from the window's first); a soft-capped model's scores are capped
// (softcap * tanh(score / softcap)) after scaling, as transformers' eager attention does.
#include "kernels.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <immintrin.h>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Vec::size() fp16 cache elements as floats.
inline Vec load(const at::Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float values[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(p[i]);
  return Vec::loadu(values);
#endif
}

constexpr int64_t kChunk = 64;  // tokens per work item
constexpr int64_t kItemWork = 8;  // an item's fixed work (staging, softmax), in tokens' worth, for sharing items out
constexpr int64_t kTokens = 4;  // keys scored together: four independent FMA chains share each load of q

// Rows of one kv head's keys or values in an fp32 cache, through a request's block table.
struct CacheRows {
  const float* base;  // this kv head's blocks
  const int64_t* table;
  int64_t block_size, head_dim;
  const float* at(int64_t t) const { return base + (table[t / block_size] * block_size + t % block_size) * head_dim; }
};

// Rows of tokens [t0, t0 + n) copied out of an fp16 cache as fp32: converted once per work item,
// where scoring and weighing each query head of the group would convert every row again.
struct StagedRows {
  const float* base;
  int64_t t0, head_dim;
  const float* at(int64_t t) const { return base + (t - t0) * head_dim; }
};

// Asks for every cache line of rows [t0, t1) at once, into the cache level Hint names. The rows lie
// in blocks scattered through the cache and were last read a step ago, so they come from memory;
// fetched one row at a time as `stage` reads them, each waited out its own miss.
template <int Hint, typename T>
void prefetch_rows(const T* base, const int64_t* table, int64_t block_size, int64_t D, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* row = reinterpret_cast<const char*>(base + (table[t / block_size] * block_size + t % block_size) * D);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(row + b, static_cast<_mm_hint>(Hint));
  }
}

void stage(const at::Half* base, const int64_t* table, int64_t block_size, int64_t D, int64_t t0, int64_t t1,
           float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const at::Half* row = base + (table[t / block_size] * block_size + t % block_size) * D;
    float* o = out + (t - t0) * D;
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) load(row + d).store(o + d);
    for (; d < D; ++d) o[d] = static_cast<float>(row[d]);
  }
}

float dot(const float* a, const float* b, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

#if defined(CPU_CAPABILITY_AVX512)
// The lane sums of 16 vectors, in one vector: a tree of 15 adds over shuffled halves, where summing
// each vector alone takes four shuffle-add levels per vector. The tree leaves input s's sum in
// lane kSlot[s] (a self-inverse order), so accumulating key j in acc[kSlot[j]] puts its score in
// lane j.
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 lane_sums(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[i], y[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[i], y[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// scores[t - t0] = q . key t for t in [t0, t1): sixteen keys at a time with one tree of lane sums
// (AVX-512), then kTokens at a time, four independent FMA chains sharing each load of q.
template <typename Rows>
void score(const float* q, const Rows& keys, int64_t D, int64_t t0, int64_t t1, float* scores) {
  int64_t t = t0;
#if defined(CPU_CAPABILITY_AVX512)
  if (D % 16 == 0) {
    for (; t + 16 <= t1; t += 16) {
      const float* k[16];
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) k[i] = keys.at(t + i), acc[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 16; ++i) acc[kSlot[i]] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[i] + d), acc[kSlot[i]]);
      }
      _mm512_storeu_ps(scores + t - t0, lane_sums(acc));
    }
  }
#endif
  for (; t + kTokens <= t1; t += kTokens) {
    const float* k[kTokens];
    Vec acc[kTokens];
    for (int64_t i = 0; i < kTokens; ++i) k[i] = keys.at(t + i), acc[i] = Vec(0.f);
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) {
      const Vec qd = Vec::loadu(q + d);
      for (int64_t i = 0; i < kTokens; ++i) acc[i] = at::vec::fmadd(qd, Vec::loadu(k[i] + d), acc[i]);
    }
    for (int64_t i = 0; i < kTokens; ++i) {
      float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[i]);
      for (int64_t e = d; e < D; ++e) s += q[e] * k[i][e];
      scores[t + i - t0] = s;
    }
  }
  for (; t < t1; ++t) scores[t - t0] = dot(q, keys.at(t), D);
}

// outs[g][d0, d0 + kVecs * Vec::size()) = sum over t in [t0, t1) of p[g * kChunk + t - t0] * value
// t, for kHeads query heads: each value row is loaded once for all of them, and the outputs stay in
// registers while the tokens stream past (sizes fixed at compile time, or the arrays live in memory).
template <int kHeads, int kVecs, typename Rows>
void weigh_block(const float* p, const Rows& values, int64_t d0, int64_t t0, int64_t t1, float* const* outs) {
  Vec acc[kHeads][kVecs];
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < kVecs; ++j) acc[g][j] = Vec(0.f);
  for (int64_t t = t0; t < t1; ++t) {
    const float* v = values.at(t) + d0;
    Vec row[kVecs];
    for (int j = 0; j < kVecs; ++j) row[j] = Vec::loadu(v + j * Vec::size());
    for (int g = 0; g < kHeads; ++g) {
      const Vec pt(p[g * kChunk + t - t0]);
      for (int j = 0; j < kVecs; ++j) acc[g][j] = at::vec::fmadd(pt, row[j], acc[g][j]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < kVecs; ++j) acc[g][j].store(outs[g] + d0 + j * Vec::size());
}

template <int kHeads, typename Rows>
void weigh_heads(const float* p, const Rows& values, int64_t D, int64_t t0, int64_t t1, float* const* outs) {
  constexpr int64_t kWide = 4;  // vectors of output per head per pass
  int64_t d0 = 0;
  for (; d0 + kWide * Vec::size() <= D; d0 += kWide * Vec::size()) weigh_block<kHeads, kWide>(p, values, d0, t0, t1, outs);
  for (; d0 + Vec::size() <= D; d0 += Vec::size()) weigh_block<kHeads, 1>(p, values, d0, t0, t1, outs);
  for (int64_t d = d0; d < D; ++d)
    for (int g = 0; g < kHeads; ++g) {
      float s = 0.f;
      for (int64_t t = t0; t < t1; ++t) s += p[g * kChunk + t - t0] * values.at(t)[d];
      outs[g][d] = s;
    }
}

// outs[g][0, D) = sum over t in [t0, t1) of p[g * kChunk + t - t0] * value t for the G query heads of
// a kv head, up to four at a time.
template <typename Rows>
void weigh(const float* p, int64_t G, const Rows& values, int64_t D, int64_t t0, int64_t t1, float* const* outs) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* pg = p + g0 * kChunk;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: weigh_heads<1>(pg, values, D, t0, t1, outs + g0); break;
      case 2: weigh_heads<2>(pg, values, D, t0, t1, outs + g0); break;
      case 3: weigh_heads<3>(pg, values, D, t0, t1, outs + g0); break;
      default: weigh_heads<4>(pg, values, D, t0, t1, outs + g0);
    }
  }
}

// One (request chunk, kv head) work item: each query head's partial softmax over tokens [t0, t1)
// into parts[g]: max score, sum of exp, then D of unnormalised output.
template <typename Rows>
void attend_chunk(const float* q, int64_t G, const Rows& keys, const Rows& values, int64_t D, int64_t t0,
                  int64_t t1, float scale, float softcap, float* scores, float* const* parts, float* const* outs) {
  const int64_t n = t1 - t0;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * kChunk;
    score(q + g * D, keys, D, t0, t1, s);
    if (softcap > 0.f)
      for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] * scale / softcap);
    else
      for (int64_t t = 0; t < n; ++t) s[t] *= scale;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, s, s, n);
    parts[g][0] = mx;
    parts[g][1] = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
  }
  weigh(scores, G, values, D, t0, t1, outs);
}

template <typename T>
void attend_items(const DecodeAttention& a, const float* q, const T* cache, int64_t begin, int64_t end) {
  const int64_t D = a.D, G = a.H / a.KVH, head = a.NB * a.BS * D;
  const T* values = cache + a.KVH * head;
  std::vector<float> scores(G * kChunk), staged(std::is_same<T, float>::value ? 0 : 2 * kChunk * D);
  std::vector<float*> parts(G), outs(G);
  for (int64_t index = begin; index < end; ++index) {
    const DecodeAttention::Item item = a.item(index);
    for (int64_t g = 0; g < G; ++g) parts[g] = a.partial.get() + (index * G + g) * a.stride(), outs[g] = parts[g] + 2;
    const float* qh = q + (item.b * a.H + item.h * G) * D;
    const T *keys_base = cache + item.h * head, *values_base = values + item.h * head;
    if constexpr (std::is_same<T, float>::value) {
      const CacheRows keys{keys_base, item.table, a.BS, D}, vals{values_base, item.table, a.BS, D};
      attend_chunk(qh, G, keys, vals, D, item.t0, item.t1, a.scale, a.softcap, scores.data(), parts.data(),
                   outs.data());
    } else {
      prefetch_rows<_MM_HINT_T0>(keys_base, item.table, a.BS, D, item.t0, item.t1);
      prefetch_rows<_MM_HINT_T0>(values_base, item.table, a.BS, D, item.t0, item.t1);
      stage(keys_base, item.table, a.BS, D, item.t0, item.t1, staged.data());
      stage(values_base, item.table, a.BS, D, item.t0, item.t1, staged.data() + kChunk * D);
      const StagedRows keys{staged.data(), item.t0, D}, vals{staged.data() + kChunk * D, item.t0, D};
      attend_chunk(qh, G, keys, vals, D, item.t0, item.t1, a.scale, a.softcap, scores.data(), parts.data(),
                   outs.data());
    }
  }
}

template <typename T>
void prefetch_items(const DecodeAttention& a, const T* cache, int64_t begin, int64_t end) {
  const int64_t head = a.NB * a.BS * a.D;
  for (int64_t index = begin; index < end; ++index) {
    const DecodeAttention::Item item = a.item(index);
    prefetch_rows<_MM_HINT_T1>(cache + item.h * head, item.table, a.BS, a.D, item.t0, item.t1);
    prefetch_rows<_MM_HINT_T1>(cache + (a.KVH + item.h) * head, item.table, a.BS, a.D, item.t0, item.t1);
  }
}

}  // namespace

DecodeAttention::DecodeAttention(int64_t num_heads, const torch::Tensor& layer_cache, const torch::Tensor& block_tables,
                                 const torch::Tensor& seq_lens, double scale, int64_t window, double softcap)
    : B(seq_lens.numel()), H(num_heads), KVH(layer_cache.size(1)), NB(layer_cache.size(2)), BS(layer_cache.size(3)),
      D(layer_cache.size(4)), max_blocks(block_tables.size(1)), window(window), half(layer_cache.scalar_type() == torch::kHalf),
      scale(static_cast<float>(scale)), softcap(static_cast<float>(softcap)), tables(block_tables.data_ptr<int64_t>()),
      lens(seq_lens.data_ptr<int64_t>()), first_chunk(B + 1, 0) {
  TORCH_CHECK(layer_cache.scalar_type() == torch::kFloat32 || half, "cache: fp32 or fp16");
  TORCH_CHECK(layer_cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong &&
                  block_tables.size(0) >= B, "block_tables (B, max blocks), seq_lens (B): int64");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window, softcap: 0 (none) or positive");
  for (int64_t b = 0; b < B; ++b) first_chunk[b + 1] = first_chunk[b] + (lens[b] - first_key(b) + kChunk - 1) / kChunk;
  partial = scratch<float>(num_items() * (H / KVH) * stride());
  work_before.assign(num_items() + 1, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t chunk = first_chunk[b]; chunk < first_chunk[b + 1]; ++chunk) {
      const int64_t tokens = std::min(kChunk, lens[b] - first_key(b) - (chunk - first_chunk[b]) * kChunk);
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t item = chunk * KVH + h;
        work_before[item + 1] = work_before[item] + tokens + kItemWork;
      }
    }
}

std::pair<int64_t, int64_t> DecodeAttention::items_of(int64_t thread, int64_t threads) const {
  // the item boundary nearest to each thread's even share of the work
  const auto boundary = [&](int64_t t) {
    const int64_t n = num_items(), target = work_before[n] * t / threads;
    int64_t i = std::lower_bound(work_before.begin(), work_before.end(), target) - work_before.begin();
    if (i > 0 && target - work_before[i - 1] < work_before[i] - target) --i;
    return std::min(i, n);
  };
  return {boundary(thread), boundary(thread + 1)};
}

int64_t DecodeAttention::num_items() const { return first_chunk[B] * KVH; }

DecodeAttention::Item DecodeAttention::item(int64_t index) const {
  const int64_t chunk = index / KVH, b = std::upper_bound(first_chunk.begin(), first_chunk.end(), chunk) - first_chunk.begin() - 1;
  const int64_t t0 = first_key(b) + (chunk - first_chunk[b]) * kChunk;
  return {b, index % KVH, t0, std::min(lens[b], t0 + kChunk), tables + b * max_blocks};
}

void DecodeAttention::attend(const float* q, const void* layer_cache, int64_t begin, int64_t end) const {
  if (half)
    attend_items(*this, q, static_cast<const at::Half*>(layer_cache), begin, end);
  else
    attend_items(*this, q, static_cast<const float*>(layer_cache), begin, end);
}

void DecodeAttention::prefetch(const void* layer_cache, int64_t begin, int64_t end) const {
  if (half)
    prefetch_items(*this, static_cast<const at::Half*>(layer_cache), begin, end);
  else
    prefetch_items(*this, static_cast<const float*>(layer_cache), begin, end);
}

void DecodeAttention::merge(float* out, int64_t begin, int64_t end) const {
  const int64_t G = H / KVH;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / H, h = row % H / G, g = row % G;
    auto part = [&](int64_t chunk) { return partial.get() + ((chunk * KVH + h) * G + g) * stride(); };
    float mx = -INFINITY;
    for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) mx = std::max(mx, part(c)[0]);
    float* o = out + row * D;
    std::fill(o, o + D, 0.f);
    float sum = 0.f;
    for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) {
      const float* pc = part(c);
      const float w = std::exp(pc[0] - mx);
      sum += w * pc[1];
      for (int64_t d = 0; d < D; ++d) o[d] += w * pc[2 + d];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no context: zeros
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

// q (B, H, D); cache (2, KVH, NB, BS, D) fp32 or fp16; block_tables (B, M) int64; seq_lens (B) int64
// -> out (B, H, D)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q: fp32");
  q = q.contiguous();
  const DecodeAttention attention(q.size(1), cache, block_tables, seq_lens, scale, window, softcap);
  TORCH_CHECK(q.size(0) == attention.B && q.size(2) == attention.D, "q: (B, H, head_dim)");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, attention.num_items(), 1,
                   [&](int64_t begin, int64_t end) { attention.attend(qp, cache.data_ptr(), begin, end); });
  float* op = out.data_ptr<float>();
  at::parallel_for(0, attention.B * attention.H, 16, [&](int64_t begin, int64_t end) { attention.merge(op, begin, end); });
  return out;
}
