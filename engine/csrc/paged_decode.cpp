// Paged decode attention for CPU: one query token per request attends over its KV blocks, read
// in place through the block table (no gather copy). fp32. Parallel over (request, kv head).
#include "kernels.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <vector>

using Vec = at::vec::Vectorized<float>;

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

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH, L = lens[b];
      scores.resize(G * L);
      const float* qh = qp + (b * H + h * G) * D;  // the G query heads of this kv head
      const int64_t* table = tables + b * M;
      for (int64_t t0 = 0; t0 < L; t0 += BS) {  // block by block: one table lookup per block
        const float* kb = kp + (h * NB + table[t0 / BS]) * BS * D;
        for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
          const float* k = kb + (t - t0) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qh + g * D;
            Vec acc(0.f);
            int64_t d = 0;
            for (; d + Vec::size() <= D; d += Vec::size()) {
              acc = at::vec::fmadd(Vec::loadu(qg + d), Vec::loadu(k + d), acc);
            }
            float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
            for (; d < D; ++d) s += qg[d] * k[d];
            scores[g * L + t] = s * fscale;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, sg, sg, L);
        const float sum = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sg, L);
        const float inv = 1.f / sum;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, sg, sg, L);
      }
      float* oh = op + (b * H + h * G) * D;
      std::fill(oh, oh + G * D, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const float* vb = vp + (h * NB + table[t0 / BS]) * BS * D;
        for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
          const float* v = vb + (t - t0) * D;
          for (int64_t g = 0; g < G; ++g) {
            const Vec p(scores[g * L + t]);
            float* og = oh + g * D;
            int64_t d = 0;
            for (; d + Vec::size() <= D; d += Vec::size()) {
              at::vec::fmadd(p, Vec::loadu(v + d), Vec::loadu(og + d)).store(og + d);
            }
            for (; d < D; ++d) og[d] += scores[g * L + t] * v[d];
          }
        }
      }
    }
  });
  return out;
}
