// LoRA adapters' deltas for a step's rows, each row with its own adapter (or none): y += B (A x) per row,
// over the adapters a model holds in slots (engine/lora.py). Two phases, as Punica's SGMV kernels split
// them: shrink (u = A x, the rank's few columns per row) then expand (u's segments times B^T into the
// matmul's output columns). A and B are fp32 or bf16 (half the bytes a decode step reads for them; a
// bf16 value widened to fp32 is a shift), x, u and the sums fp32. Rows split among threads where the
// step has rows enough for each; a few rows (decode of a few streams) split shrink's (row, column)
// items, then expand's output columns.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>

namespace {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename W>
float dot(const float* x, const W* w, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * widen(w[i]);
  return s;
}

template <typename W>
void axpy(float coefficient, const W* w, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += coefficient * widen(w[i]);
}

template <typename W>
const W* elements(const torch::Tensor& t) {
  return static_cast<const W*>(t.data_ptr());
}

float shrink_one(const LoraMatmul& m, const float* x, int64_t K, int64_t j) {
  return m.bf16 ? dot(x, elements<uint16_t>(m.a) + j * K, K) : dot(x, elements<float>(m.a) + j * K, K);
}

// y's columns [c0, c1) += u's segments of adapter matmul m times B^T
void expand_row(const LoraMatmul& m, const float* u, float* y, int64_t c0, int64_t c1) {
  for (size_t s = 0; s < m.segments.size(); ++s) {
    const auto [j0, r, n0, n] = m.segments[s];
    const int64_t from = std::max(c0, n0), to = std::min(c1, n0 + n);
    if (from >= to) continue;
    for (int64_t j = 0; j < r; ++j) {
      const float coefficient = u[j0 + j];
      if (m.bf16)
        axpy(coefficient, elements<uint16_t>(m.b[s]) + j * n + (from - n0), y + from, to - from);
      else
        axpy(coefficient, elements<float>(m.b[s]) + j * n + (from - n0), y + from, to - from);
    }
  }
}

constexpr size_t kLoraBlockRows = 4;  // rows of one adapter sharing each load of its A's and B's values

// Rows `rows` (C of them, one adapter's) of x (., K): u (C, R) = A x, then their y (., N) += u's
// segments times B^T, each weight loaded once for the C rows.
template <int C, typename W>
void lora_block_rows(const LoraMatmul& m, const int64_t* rows, const float* x, int64_t K, float* y, int64_t N,
                     float* u) {
  const W* a = elements<W>(m.a);
  const int64_t R = m.rank();
  const float* xs[C];
  for (int i = 0; i < C; ++i) xs[i] = x + rows[i] * K;
  for (int64_t j = 0; j < R; ++j) {
    const W* aj = a + j * K;
    float sums[C] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float w = widen(aj[k]);
      for (int i = 0; i < C; ++i) sums[i] += xs[i][k] * w;
    }
    for (int i = 0; i < C; ++i) u[i * R + j] = sums[i];
  }
  for (size_t s = 0; s < m.segments.size(); ++s) {
    const auto [j0, r, n0, n] = m.segments[s];
    const W* bt = elements<W>(m.b[s]);
    for (int64_t j = 0; j < r; ++j) {
      float coefficient[C];
      float* out[C];
      for (int i = 0; i < C; ++i) {
        coefficient[i] = u[i * R + j0 + j];
        out[i] = y + rows[i] * N + n0;
      }
      const W* row = bt + j * n;
      for (int64_t c = 0; c < n; ++c) {
        const float w = widen(row[c]);
        for (int i = 0; i < C; ++i) out[i][c] += coefficient[i] * w;
      }
    }
  }
}

template <typename W>
void lora_block_typed(const LoraMatmul& m, const int64_t* rows, int64_t count, const float* x, int64_t K, float* y,
                      int64_t N, float* u) {
  switch (count) {
    case 1: lora_block_rows<1, W>(m, rows, x, K, y, N, u); break;
    case 2: lora_block_rows<2, W>(m, rows, x, K, y, N, u); break;
    case 3: lora_block_rows<3, W>(m, rows, x, K, y, N, u); break;
    default: lora_block_rows<4, W>(m, rows, x, K, y, N, u); break;
  }
}

void lora_block(const LoraMatmul& m, const int64_t* rows, int64_t count, const float* x, int64_t K, float* y,
                int64_t N, float* u) {
  if (m.bf16)
    lora_block_typed<uint16_t>(m, rows, count, x, K, y, N, u);
  else
    lora_block_typed<float>(m, rows, count, x, K, y, N, u);
}

}  // namespace


int64_t lora_width(const std::vector<const LoraMatmul*>& rows) {
  int64_t width = 0;
  for (const LoraMatmul* m : rows)
    if (m != nullptr) width = std::max(width, m->rank());
  return width;
}

void lora_shrink(const std::vector<const LoraMatmul*>& rows, const float* x, int64_t K, float* u, int64_t width,
                 int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = i / width, j = i % width;
    const LoraMatmul* m = rows[t];
    if (m != nullptr && j < m->rank()) u[i] = shrink_one(*m, x + t * K, K, j);
  }
}

void lora_expand(const std::vector<const LoraMatmul*>& rows, const float* u, int64_t width, float* y, int64_t N,
                 int64_t c0, int64_t c1) {
  for (size_t t = 0; t < rows.size(); ++t)
    if (rows[t] != nullptr) expand_row(*rows[t], u + t * width, y + static_cast<int64_t>(t) * N, c0, c1);
}

void LoraSlots::set(int64_t slot, int64_t layer, int64_t which, torch::Tensor a, std::vector<torch::Tensor> b,
                    torch::Tensor segments, int64_t N) {
  TORCH_CHECK(slot >= 0 && layer >= 0 && layer < num_layers_ && which >= 0 && which < 4, "slot, layer, which");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && (a.scalar_type() == torch::kFloat ||
                                                    a.scalar_type() == torch::kBFloat16),
              "a: contiguous fp32 or bf16 (R, K)");
  TORCH_CHECK(a.size(0) <= 3 * 256, "a: at most three parts of rank 256 (R <= 768)");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 4 && segments.scalar_type() == torch::kLong &&
                  segments.is_contiguous() && static_cast<size_t>(segments.size(0)) == b.size(),
              "segments: int64 (S, 4), one per b");
  LoraMatmul m{a, b, {}, a.scalar_type() == torch::kBFloat16};
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (size_t s = 0; s < b.size(); ++s) {
    const int64_t j0 = seg[4 * s], r = seg[4 * s + 1], n0 = seg[4 * s + 2], n = seg[4 * s + 3];
    TORCH_CHECK(j0 >= 0 && r > 0 && j0 + r <= a.size(0) && n0 >= 0 && n > 0 && n0 + n <= N,
                "a segment: columns of A x within R, rows of the output within N");
    TORCH_CHECK(b[s].scalar_type() == a.scalar_type() && b[s].is_contiguous() && b[s].dim() == 2 &&
                    b[s].size(0) == r && b[s].size(1) == n, "b: contiguous (r, n) per segment, a's dtype");
    m.segments.push_back({j0, r, n0, n});
  }
  if (static_cast<int64_t>(slots_.size()) <= slot) slots_.resize(slot + 1);
  slots_[slot].resize(4 * num_layers_);
  slots_[slot][4 * layer + which] = std::move(m);
}

void LoraSlots::clear(int64_t slot) {
  if (slot >= 0 && slot < static_cast<int64_t>(slots_.size())) slots_[slot].clear();
}

void LoraSlots::check_slots(const torch::Tensor& slots) const {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kLong && slots.is_contiguous(), "slots: int64 (T)");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t count = static_cast<int64_t>(slots_.size());
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] == -1 || (slot[t] >= 0 && slot[t] < count && !slots_[slot[t]].empty()),
                "slots: an installed adapter's slot, or -1");
}

std::vector<const LoraMatmul*> LoraSlots::rows(int64_t layer, int64_t which, const int64_t* slots, int64_t T) const {
  std::vector<const LoraMatmul*> rows(T, nullptr);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0 && slots_[slots[t]][4 * layer + which].a.defined()) rows[t] = &slots_[slots[t]][4 * layer + which];
  return rows;
}

void LoraSlots::add(int64_t layer, int64_t which, const torch::Tensor& x, const torch::Tensor& y,
                    const torch::Tensor& slots) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers_ && which >= 0 && which < 4, "layer, which");
  check_slots(slots);
  const int64_t T = slots.numel();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == T && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x: contiguous fp32 (T, K)");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.scalar_type() == torch::kFloat && y.is_contiguous(),
              "y: contiguous fp32 (T, N)");
  const std::vector<const LoraMatmul*> per_row = rows(layer, which, slots.data_ptr<int64_t>(), T);
  const int64_t width = lora_width(per_row), K = x.size(1), N = y.size(1);
  if (width == 0) return;
  for (const LoraMatmul* m : per_row)
    TORCH_CHECK(m == nullptr || (m->a.size(1) == K && std::all_of(m->segments.begin(), m->segments.end(),
                                                                    [&](const auto& s) { return s[2] + s[3] <= N; })),
                "x, y: the adapter matmul's K and N");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (T >= 4 * at::get_num_threads()) {  // rows enough: blocks of a group's rows, each thread both phases of its own
    std::vector<int64_t> order;  // the rows with an adapter, grouped by it (stable)
    for (int64_t t = 0; t < T; ++t)
      if (per_row[t] != nullptr) order.push_back(t);
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return per_row[p] < per_row[q]; });
    std::vector<std::pair<int64_t, int64_t>> blocks;  // [begin, end) of `order`: one adapter, up to kLoraBlockRows
    for (size_t i = 0; i < order.size();) {
      size_t end = i + 1;
      while (end < order.size() && end - i < kLoraBlockRows && per_row[order[end]] == per_row[order[i]]) ++end;
      blocks.emplace_back(i, end);
      i = end;
    }
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
      std::array<float, kLoraBlockRows * 3 * 256> u{};  // a block's A x: rows x (R <= 3 x max rank)
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t* rows = order.data() + blocks[b].first;
        const int64_t count = blocks[b].second - blocks[b].first;
        lora_block(*per_row[rows[0]], rows, count, xp, K, yp, N, u.data());
      }
    });
    return;
  }
  Scratch<float> u = scratch<float>(T * width);
  at::parallel_for(0, T * width, 1, [&](int64_t b, int64_t e) { lora_shrink(per_row, xp, K, u.get(), width, b, e); });
  at::parallel_for(0, N, 64, [&](int64_t c0, int64_t c1) { lora_expand(per_row, u.get(), width, yp, N, c0, c1); });
}
