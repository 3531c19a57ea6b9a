// A decode step through a Llama-family stack of block-quantized layers in one call: per layer,
// RMSNorm + qkv (block_quant_linear), RoPE on q and k with k and v written to their cache slots
// (rope_write_kv), paged attention (paged_decode_attention), o + residual, RMSNorm + gate/up,
// SwiGLU + down + residual:
// engine/models/llama.py's LlamaLayer.forward, with the same kernels and the same arithmetic (past
// kernel_rows tokens the vector GEMM, as BlockQuantLinear runs it). At one token the Python
// path's per-op overhead (about twenty torch ops and module calls per layer) costs as much as the
// matmuls; here a step makes one call.
//
// Where every matmul runs block_quant_linear's kernel (decode steps), one thread team runs the whole
// step (forward_team): each op's rows or work items are shared out among the threads with a barrier
// between ops, each thread quantizes a matmul's activations itself, and the buffers are made once.
// Per op, at::parallel_for woke the team and joined it (~2 µs of a 7-27 µs matmul at one token)
// after the calling thread alone had normed, quantized and allocated (~2 µs more). The team also
// asks for each layer's KV slots before its qkv matmul (prefetch_kv_slots), and each thread for its
// attention items' keys and values of the next layer before this layer's down matmul
// (DecodeAttention::prefetch): read from memory as the items came, attention waited out its misses
// (~430-470 µs of a ~2 ms stack at a 300-token context; ~250-300 with them in L2 beforehand, while
// the down matmul, sharing the memory's bandwidth with them, takes ~70 µs longer). Larger batches,
// which take the vector GEMM (itself parallel), go op by op.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <immintrin.h>
#include <omp.h>
#include <thread>

DecodeStack::DecodeStack(std::vector<torch::Tensor> rows, std::vector<int64_t> formats,
                         std::vector<c10::optional<torch::Tensor>> biases, std::vector<torch::Tensor> norms,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         std::vector<c10::optional<torch::Tensor>> tiles,
                         std::vector<c10::optional<torch::Tensor>> scales,
                         std::vector<c10::optional<torch::Tensor>> offsets, int64_t kernel_rows)
    : rows_(std::move(rows)), formats_(std::move(formats)), biases_(std::move(biases)), norms_(std::move(norms)),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), tiles_(std::move(tiles)),
      scales_(std::move(scales)), offsets_(std::move(offsets)), kernel_rows_(kernel_rows) {
  TORCH_CHECK(rows_.size() % kMatmuls == 0 && formats_.size() == rows_.size() && biases_.size() == rows_.size() &&
                  norms_.size() == rows_.size() / kMatmuls * 2,
              "per layer: four matmuls (qkv, o, gate_up, down) and two norms (input, post-attention)");
  TORCH_CHECK(tiles_.size() == rows_.size() && scales_.size() == rows_.size() && offsets_.size() == rows_.size(),
              "tiles, scales, offsets: one (or None) per matmul");
  for (size_t i = 0; i < tiles_.size(); ++i)
    TORCH_CHECK(tiles_[i].has_value() == scales_[i].has_value(), "a matmul's tiles come with its scales");
  // forward_team reads these raw, where nothing may throw: their types checked once, here
  for (size_t i = 0; i < rows_.size(); ++i) {
    TORCH_CHECK(formats_[i] >= 0 && formats_[i] <= 2, "format: 0 (Q8_0), 1 (Q4_1) or 2 (Q8_0, bf16 activations)");
    TORCH_CHECK(rows_[i].dim() == 2 && rows_[i].scalar_type() == torch::kByte && rows_[i].is_contiguous(),
                "rows: contiguous uint8 (N, K / 32 * block bytes)");
    TORCH_CHECK(!biases_[i].has_value() || (biases_[i]->scalar_type() == torch::kFloat && biases_[i]->is_contiguous() &&
                    biases_[i]->numel() == rows_[i].size(0)), "bias: contiguous fp32 (N)");
  }
  for (const torch::Tensor& norm : norms_)
    TORCH_CHECK(norm.scalar_type() == torch::kFloat && norm.is_contiguous(), "norms: contiguous fp32");
  for (int64_t l = 0; l < num_layers(); ++l) {
    const int64_t i = l * kMatmuls;
    const auto columns = [&](int64_t m) { return block_quant_columns(rows_[i + m], formats_[i + m]); };
    const int64_t hidden = columns(0);
    TORCH_CHECK(rows_[i].size(0) == (num_heads_ + 2 * num_kv_heads_) * head_dim_ && columns(1) == num_heads_ * head_dim_ &&
                    rows_[i + 1].size(0) == hidden && columns(2) == hidden && rows_[i + 2].size(0) == 2 * columns(3) &&
                    rows_[i + 3].size(0) == hidden && norms_[2 * l].numel() == hidden &&
                    norms_[2 * l + 1].numel() == hidden,
                "a layer: qkv (heads + 2 kv heads) x hidden, o hidden x heads, gate_up 2 intermediate x hidden, "
                "down hidden x intermediate, norms hidden");
  }
}

torch::Tensor DecodeStack::matmul(int64_t i, const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_weight,
                                  bool swiglu, const c10::optional<torch::Tensor>& residual) const {
  if (tiles_[i].has_value() && x.size(0) > kernel_rows_)
    return vector_gemm(x, *tiles_[i], *scales_[i], offsets_[i], biases_[i], norm_weight, eps_, swiglu, residual);
  return block_quant_linear(x, rows_[i], formats_[i], biases_[i], norm_weight, eps_, swiglu, residual);
}

int64_t DecodeStack::num_layers() const { return static_cast<int64_t>(rows_.size()) / kMatmuls; }

torch::Tensor DecodeStack::forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                   int64_t num_layers) const {
  const int64_t T = hidden.size(0), D = head_dim_, H = num_heads_, KVH = num_kv_heads_;
  TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "num_layers: at most the stack's");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos, sin: contiguous (T, head_dim)");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat, "hidden, cos, sin: fp32");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat || kv_cache.scalar_type() == torch::kHalf,
              "kv_cache: fp32 or fp16");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(2) == KVH && kv_cache.size(5) == D,
              "kv_cache: contiguous (layers, 2, kv_heads, blocks, block_size, head_dim)");
  hidden = hidden.contiguous();
  const bool vector_gemm_rows =
      T > kernel_rows_ && std::any_of(tiles_.begin(), tiles_.end(), [](const auto& t) { return t.has_value(); });
  if (!vector_gemm_rows) return forward_team(hidden, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, scale,
                                              num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t i = l * kMatmuls;
    const torch::Tensor layer_cache = kv_cache[l];
    const torch::Tensor qkv = matmul(i, hidden, norms_[2 * l], false, c10::nullopt);
    const torch::Tensor q = rope_write_kv(qkv, cos, sin, layer_cache, slot_mapping, H, false);
    const torch::Tensor attn = paged_decode_attention(q, layer_cache, block_tables, seq_lens, scale).view({T, H * D});
    hidden = matmul(i + 1, attn, c10::nullopt, false, hidden);
    const torch::Tensor gate_up = matmul(i + 2, hidden, norms_[2 * l + 1], false, c10::nullopt);
    hidden = matmul(i + 3, gate_up, c10::nullopt, true, hidden);
  }
  return hidden;
}

namespace {

// The team's barrier between ops: the threads spin on a generation count. libgomp's barrier makes
// a futex_wake syscall at every release, waiter asleep or not: ~240 a step, ~45,000 a second.
// A thread that has spun some tens of µs yields its core, for a partner that lost its own.
class SpinBarrier {
 public:
  void wait(int64_t threads) {  // the team's size
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation;) {
      if (spins < kSpins) {
        ++spins;
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2000;
  std::atomic<int64_t> arrived_{0};
  std::atomic<unsigned> generation_{0};
};

}  // namespace

torch::Tensor DecodeStack::forward_team(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                        int64_t num_layers) const {
  const int64_t T = hidden.size(0), D = head_dim_, H = num_heads_;
  int64_t widest = 0;  // the widest matmul output held between ops: qkv's or gate_up's
  for (const torch::Tensor& r : rows_) widest = std::max(widest, r.size(0));
  const torch::Tensor out = hidden.clone();  // the residual stream, updated in place
  const torch::Tensor wide = torch::empty({T, widest}, hidden.options());
  const torch::Tensor q = torch::empty({T, H, D}, hidden.options()), attn = torch::empty({T, H * D}, hidden.options());
  // every check before the team: nothing may throw inside it
  if (num_layers > 0) {
    TORCH_CHECK(hidden.size(1) == block_quant_columns(rows_[0], formats_[0]), "hidden: (T, the layers' hidden size)");
    const int64_t qkv_width = rows_[0].size(0);
    check_rope_write_kv(wide.view(-1).narrow(0, 0, T * qkv_width).view({T, qkv_width}), cos, sin, kv_cache[0],
                        slot_mapping, H);
  }
  const DecodeAttention attention(H, kv_cache[0], block_tables, seq_lens, scale);
  TORCH_CHECK(attention.B == T, "seq_lens: one per token");
  float* const hp = out.data_ptr<float>();
  float* const wp = wide.data_ptr<float>();
  float* const qp = q.data_ptr<float>();
  float* const ap = attn.data_ptr<float>();
  const int64_t layer_bytes = kv_cache.numel() / kv_cache.size(0) * kv_cache.element_size();
  const char* const cache = static_cast<const char*>(kv_cache.data_ptr());

  SpinBarrier barrier;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    // this thread's part of [0, count), split as at::parallel_for splits it
    const auto part = [&](int64_t count) {
      const int64_t chunk = (count + threads - 1) / threads, begin = std::min(count, thread * chunk);
      return std::pair<int64_t, int64_t>{begin, std::min(count, begin + chunk)};
    };
    // work on this thread's part, then wait for the others
    const auto share = [&](std::pair<int64_t, int64_t> range, const auto& work) {
      if (range.first < range.second) work(range.first, range.second);
      barrier.wait(threads);
    };
    // matmul i of x (T, K) after its prologue, each thread quantizing x itself (no wait for one to)
    const auto matmul = [&](int64_t i, const float* x, const float* norm, bool swiglu, const float* residual, float* y) {
      const LinearInput in = linear_input(x, T, block_quant_columns(rows_[i], formats_[i]), norm, eps_, swiglu,
                                          formats_[i]);
      const uint8_t* blocks = rows_[i].data_ptr<uint8_t>();
      const float* bias = biases_[i].has_value() ? biases_[i]->data_ptr<float>() : nullptr;
      const int64_t N = rows_[i].size(0);
      share(part(N), [&](int64_t n0, int64_t n1) { linear_rows(in, blocks, formats_[i], N, bias, residual, y, n0, n1); });
    };
    // this thread's attention items of layer l, asked for into L2 ahead of its attention
    const auto [first_item, last_item] = attention.items_of(thread, threads);
    const auto prefetch_attention = [&](int64_t l) { attention.prefetch(cache + l * layer_bytes, first_item, last_item); };
    if (num_layers > 0) prefetch_attention(0);
    for (int64_t l = 0; l < num_layers; ++l) {
      const int64_t i = l * kMatmuls;
      if (thread == 0) prefetch_kv_slots(kv_cache, l, slot_mapping);
      matmul(i, hp, norms_[2 * l].data_ptr<float>(), false, nullptr, wp);
      share(part(T * (H + num_kv_heads_)), [&](int64_t b, int64_t e) {
        rope_write_kv_into(wp, cos.data_ptr<float>(), sin.data_ptr<float>(), slot_mapping.data_ptr<int64_t>(), H,
                           kv_cache, l, qp, b, e);
      });
      share({first_item, last_item}, [&](int64_t b, int64_t e) { attention.attend(qp, cache + l * layer_bytes, b, e); });
      share(part(T * H), [&](int64_t b, int64_t e) { attention.merge(ap, b, e); });
      matmul(i + 1, ap, nullptr, false, hp, hp);
      matmul(i + 2, hp, norms_[2 * l + 1].data_ptr<float>(), false, nullptr, wp);
      if (l + 1 < num_layers) prefetch_attention(l + 1);
      matmul(i + 3, wp, nullptr, true, hp, hp);
    }
  }
  return out;
}
