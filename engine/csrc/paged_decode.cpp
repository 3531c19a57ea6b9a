// Paged decode attention for CPU: one query token per request attends over its KV blocks, read
// in place through the block table (no gather copy). fp32.
//
// Each request's context is cut into chunks of kChunk tokens, and each (request, kv head, chunk)
// is one work item that keeps its partial softmax (max, sum, unnormalised output) for the kv
// head's query heads; a second pass merges the chunks (flash-decoding). So one long request
// spreads over every thread, where parallelism over (request, kv head) alone left a single stream
// with three items for two threads. The chunking depends only on a request's own length, so its
// arithmetic is the same alone or in any batch.
#include "kernels.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 64;  // tokens per work item
constexpr int64_t kTokens = 4;  // keys scored together: four independent FMA chains share each load of q

// Cache rows of one kv head's keys or values for tokens [t0, t1) of a request, through its table.
struct Rows {
  const float* base;  // this kv head's blocks
  const int64_t* table;
  int64_t block_size, head_dim;
  const float* at(int64_t t) const { return base + (table[t / block_size] * block_size + t % block_size) * head_dim; }
};

float dot(const float* a, const float* b, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// scores[t - t0] = q . key t for t in [t0, t1), kTokens keys at a time.
void score(const float* q, const Rows& keys, int64_t t0, int64_t t1, float* scores) {
  const int64_t D = keys.head_dim;
  int64_t t = t0;
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

// out[0, D) = sum over t in [t0, t1) of p[t - t0] * value t, eight vectors of out held in registers
// while the tokens stream past.
void weigh(const float* p, const Rows& values, int64_t t0, int64_t t1, float* out) {
  constexpr int64_t kVecs = 8;
  const int64_t D = values.head_dim;
  int64_t d0 = 0;
  for (; d0 + Vec::size() <= D; d0 += kVecs * Vec::size()) {
    const int64_t n = std::min(kVecs, (D - d0) / Vec::size());
    Vec acc[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) acc[j] = Vec(0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const Vec pt(p[t - t0]);
      const float* v = values.at(t) + d0;
      for (int64_t j = 0; j < n; ++j) acc[j] = at::vec::fmadd(pt, Vec::loadu(v + j * Vec::size()), acc[j]);
    }
    for (int64_t j = 0; j < n; ++j) acc[j].store(out + d0 + j * Vec::size());
  }
  for (int64_t d = D - D % Vec::size(); d < D; ++d) {
    float s = 0.f;
    for (int64_t t = t0; t < t1; ++t) s += p[t - t0] * values.at(t)[d];
    out[d] = s;
  }
}

}  // namespace

// q (B, H, D); cache (2, KVH, NB, BS, D); block_tables (B, M) int64; seq_lens (B) int64 -> out (B, H, D)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && cache.dtype() == torch::kFloat32, "fp32 only");
  q = q.contiguous();
  TORCH_CHECK(cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = cache.size(1), NB = cache.size(2), BS = cache.size(3), M = block_tables.size(1);
  const int64_t G = H / KVH;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = cache.data_ptr<float>();
  const float* vp = kp + KVH * NB * BS * D;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // first_chunk[b]: request b's first chunk among all requests' chunks
  std::vector<int64_t> first_chunk(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first_chunk[b + 1] = first_chunk[b] + (lens[b] + kChunk - 1) / kChunk;
  const int64_t chunks = first_chunk[B];
  // per (chunk, kv head, query head of the group): max score, sum of exp, then D of output
  const int64_t stride = D + 2;
  std::vector<float> partial(chunks * KVH * G * stride);

  at::parallel_for(0, chunks * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / KVH, h = item % KVH;
      const int64_t b = std::upper_bound(first_chunk.begin(), first_chunk.end(), chunk) - first_chunk.begin() - 1;
      const int64_t t0 = (chunk - first_chunk[b]) * kChunk, t1 = std::min(lens[b], t0 + kChunk), n = t1 - t0;
      const Rows keys{kp + h * NB * BS * D, tables + b * M, BS, D}, values{vp + h * NB * BS * D, tables + b * M, BS, D};
      for (int64_t g = 0; g < G; ++g) {
        float* part = partial.data() + (item * G + g) * stride;
        score(qp + (b * H + h * G + g) * D, keys, t0, t1, scores.data());
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, scores[t] *= fscale);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, scores.data(), scores.data(), n);
        part[0] = mx;
        part[1] = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, scores.data(), n);
        weigh(scores.data(), values, t0, t1, part + 2);
      }
    }
  });

  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H, h = row % H / G, g = row % G;
      auto part = [&](int64_t chunk) { return partial.data() + ((chunk * KVH + h) * G + g) * stride; };
      float mx = -INFINITY;
      for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) mx = std::max(mx, part(c)[0]);
      float* o = op + row * D;
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
  });
  return out;
}
