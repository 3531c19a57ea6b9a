// A decode step through a stack of block-quantized decoder layers in one call: per layer, RMSNorm +
// qkv (block_quant_linear), RoPE on q and k (q/k norms first where the layer has them) with k and v
// written to their cache slots (rope_write_kv), paged attention over the layer's KV group
// (paged_decode_attention, within the group's window), o (+ post-attention norm) + residual,
// RMSNorm + gate/up, the gated activation + down (+ post-MLP norm) + residual, or in the MLP's place
// a mixture of experts: engine/models/decoder.py's DecoderLayer.forward, with the same kernels and
// the same arithmetic (past kernel_rows tokens the vector GEMM, as BlockQuantLinear runs it). At one
// token the Python path's per-op overhead (about twenty torch ops and module calls per layer) costs
// as much as the matmuls; here a step makes one call.
//
// Where every matmul runs block_quant_linear's kernel (decode steps), one thread team runs the whole
// step (forward_team): each op's rows or work items are shared out among the threads with a barrier
// between ops, each thread quantizes a matmul's activations itself, and the buffers are made once.
// Per op, at::parallel_for woke the team and joined it (~2 µs of a 7-27 µs matmul at one token)
// after the calling thread alone had normed, quantized and allocated (~2 µs more). The team also
// asks for each layer's KV slots before its qkv matmul (prefetch_kv_slots), and each thread for its
// attention items' keys and values of the next layer before this layer's last matmul
// (DecodeAttention::prefetch): read from memory as the items came, attention waited out its misses
// (~430-470 µs of a ~2 ms stack at a 300-token context; ~250-300 with them in L2 beforehand, while
// the down matmul, sharing the memory's bandwidth with them, takes ~70 µs longer). Larger batches,
// which take the vector GEMM (itself parallel), go op by op.
//
// LoRA adapters (lora_slots: each token's adapter slot): in the team each adapted matmul first shares out
// its rows' A x (lora.cpp's shrink), then each thread adds its output columns' deltas right after its
// columns of the matmul: one barrier more per adapted matmul. Op by op, LoraSlots::add after each matmul.
//
// Experts: one thread routes every token (fp32 logits, softmax, top-k, renormalised where the
// family does) and gathers each routed expert's tokens; then each expert the step routes to runs
// its two matmuls over its tokens (its weights read once), and the threads add its weighted
// outputs into their columns, expert after expert, so every sum is made in one order.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <immintrin.h>
#include <numeric>
#include <omp.h>
#include <thread>

namespace {

constexpr int64_t kQkv = 0, kO = 1, kGateUp = 2, kDown = 3;

void check_norm(const c10::optional<torch::Tensor>& norm, int64_t n, const char* what) {
  TORCH_CHECK(!norm.has_value() || (norm->scalar_type() == torch::kFloat && norm->is_contiguous() && norm->numel() == n),
              what, ": contiguous fp32 of ", n);
}

// A post-norm's residual add, rows [t0, t1) of (T, n): y RMS-normed by w in place, then added to
// residual (where given).
void add_normed_rows(float* residual, float* y, const float* w, int64_t n, float eps, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* row = y + t * n;
    rms_norm_row(row, w, n, eps, row);
    if (residual != nullptr)
      for (int64_t k = 0; k < n; ++k) residual[t * n + k] += row[k];
  }
}

// Token t's top-k experts and weights from its router logits (E), as transformers routes: softmax
// in fp32, the k largest (ties to the lower index), renormalised to sum to one where asked.
void route(const float* logits, int64_t E, int64_t k, bool renormalize, int64_t* experts, float* weights) {
  float mx = -INFINITY, sum = 0.f;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  std::vector<float> probs(E);
  for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(logits[e] - mx);
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += probs[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    experts[j] = order[j];
    weights[j] = renormalize ? probs[order[j]] / total : probs[order[j]];
  }
}

float dot_row(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

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

DecodeStack::DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         double softcap, std::vector<int64_t> windows, int64_t kernel_rows)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      softcap_(softcap), windows_(std::move(windows)), kernel_rows_(kernel_rows) {
  TORCH_CHECK(!windows_.empty(), "windows: one per KV group (0: full attention)");
  TORCH_CHECK(softcap >= 0, "softcap: 0 (none) or positive");
}

StackMatmul DecodeStack::stack_matmul(std::vector<torch::Tensor> parts, std::vector<int64_t> formats,
                                      c10::optional<torch::Tensor> bias) const {
  // forward_team reads these raw, where nothing may throw: their types checked once, here (weight_rows)
  StackMatmul m{weight_rows(std::move(parts), std::move(formats)), std::move(bias)};
  TORCH_CHECK(!m.bias.has_value() || (m.bias->scalar_type() == torch::kFloat && m.bias->is_contiguous() &&
                                      m.bias->numel() == m.weights.N()), "bias: contiguous fp32 (N)");
  return m;
}

void DecodeStack::add_layer(std::vector<std::vector<torch::Tensor>> rows, std::vector<std::vector<int64_t>> formats,
                            std::vector<c10::optional<torch::Tensor>> biases,
                            std::vector<c10::optional<torch::Tensor>> norms, int64_t gated, int64_t slot,
                            int64_t group, int64_t rope) {
  TORCH_CHECK((rows.size() == 4 || rows.size() == 2) && formats.size() == rows.size() && biases.size() == rows.size(),
              "matmuls: qkv, o, and gate_up, down for a gated MLP");
  TORCH_CHECK(norms.size() == 6 && norms[0].has_value() && norms[1].has_value(),
              "norms: input, mlp, post-attention, post-MLP, q, k (the first two required)");
  TORCH_CHECK(gated >= kGatedNone && gated <= kGatedGelu, "gated: a kGated code");
  TORCH_CHECK(slot >= 0 && rope >= 0 && group >= 0 && group < static_cast<int64_t>(windows_.size()),
              "slot, rope: >= 0; group: one of the windows'");
  Layer layer;
  for (size_t i = 0; i < rows.size(); ++i) layer.matmuls[i] = stack_matmul(rows[i], formats[i], biases[i]);
  const auto columns = [&](int64_t m) { return layer.matmuls[m].weights.K; };
  const auto outputs = [&](int64_t m) { return layer.matmuls[m].weights.N(); };
  const int64_t hidden = columns(kQkv), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
  TORCH_CHECK(outputs(kQkv) == (H + 2 * KVH) * D && columns(kO) == H * D && outputs(kO) == hidden,
              "qkv (heads + 2 kv heads) x hidden, o hidden x heads");
  layer.gated_mlp = rows.size() == 4;
  if (layer.gated_mlp)
    TORCH_CHECK(outputs(kGateUp) == 2 * columns(kDown) && columns(kGateUp) == hidden && outputs(kDown) == hidden,
                "gate_up 2 intermediate x hidden, down hidden x intermediate");
  for (int i = 0; i < 4; ++i) check_norm(norms[i], hidden, "input, mlp, post-attention, post-MLP norms");
  check_norm(norms[4], D, "q norm");
  check_norm(norms[5], D, "k norm");
  layer.input_norm = *norms[0];
  layer.mlp_norm = *norms[1];
  layer.post_attention_norm = norms[2];
  layer.post_mlp_norm = norms[3];
  layer.q_norm = norms[4];
  layer.k_norm = norms[5];
  layer.gated = gated;
  layer.slot = slot;
  layer.group = group;
  layer.rope = rope;
  layers_.push_back(std::move(layer));
}

void DecodeStack::add_experts(torch::Tensor router, std::vector<std::vector<torch::Tensor>> rows,
                              std::vector<std::vector<int64_t>> formats, int64_t top_k, bool renormalize,
                              std::vector<std::vector<torch::Tensor>> shared_rows,
                              std::vector<std::vector<int64_t>> shared_formats, c10::optional<torch::Tensor> shared_gate) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gated_mlp && !layers_.back().experts,
              "add_experts follows add_layer of a layer without a gated MLP");
  const int64_t hidden = layers_.back().matmuls[kQkv].weights.K;
  const int64_t E = router.size(0);
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == torch::kFloat && router.is_contiguous() &&
                  router.size(1) == hidden, "router: contiguous fp32 (experts, hidden)");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == 2 * E && formats.size() == rows.size(),
              "rows, formats: each expert's gate_up, then its down");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k: 1 to the number of experts");
  TORCH_CHECK((shared_rows.empty() && !shared_gate.has_value()) ||
                  (shared_rows.size() == 2 && shared_formats.size() == 2 && shared_gate.has_value()),
              "shared: its gate_up and down with shared_gate, or none");
  auto experts = std::make_unique<Experts>();
  experts->router = router;
  experts->top_k = top_k;
  experts->renormalize = renormalize;
  const auto add = [&](std::vector<StackMatmul>& into, const std::vector<torch::Tensor>& gate_up,
                       const std::vector<int64_t>& gate_up_formats, const std::vector<torch::Tensor>& down,
                       const std::vector<int64_t>& down_formats) {
    into.push_back(stack_matmul(gate_up, gate_up_formats, c10::nullopt));
    into.push_back(stack_matmul(down, down_formats, c10::nullopt));
    const WeightRows &gu = into[into.size() - 2].weights, &d = into.back().weights;
    TORCH_CHECK(gu.N() == 2 * d.K && gu.K == hidden && d.N() == hidden,
                "an expert: gate_up 2 intermediate x hidden, down hidden x intermediate");
  };
  for (int64_t e = 0; e < E; ++e) add(experts->matmuls, rows[2 * e], formats[2 * e], rows[2 * e + 1], formats[2 * e + 1]);
  if (!shared_rows.empty()) {
    add(experts->shared, shared_rows[0], shared_formats[0], shared_rows[1], shared_formats[1]);
    TORCH_CHECK(shared_gate->scalar_type() == torch::kFloat && shared_gate->is_contiguous() &&
                    shared_gate->numel() == hidden, "shared_gate: contiguous fp32 (1, hidden)");
    experts->shared_gate = shared_gate;
  }
  layers_.back().experts = std::move(experts);
}

void DecodeStack::use_vector_gemm(int64_t layer, int64_t which) {
  TORCH_CHECK(layer >= 0 && layer < num_layers() && which >= 0 && which < 4, "layer, which: a layer's matmul");
  TORCH_CHECK(which < 2 || layers_[layer].gated_mlp, "that layer has experts in place of its gated MLP");
  layers_[layer].matmuls[which].vectored = true;
}

std::vector<std::vector<const LoraMatmul*>> DecodeStack::lora_rows(const c10::optional<torch::Tensor>& lora_slots,
                                                                    int64_t num_layers) const {
  std::vector<std::vector<const LoraMatmul*>> rows;
  if (!lora_slots.has_value()) return rows;
  TORCH_CHECK(loras_ != nullptr, "lora_slots given to a stack without adapters (use_lora)");
  loras_->check_slots(*lora_slots);
  const int64_t T = lora_slots->numel();
  for (int64_t i = 0; i < 4 * num_layers; ++i)
    rows.push_back(loras_->rows(i / 4, i % 4, lora_slots->data_ptr<int64_t>(), T));
  return rows;
}

torch::Tensor DecodeStack::matmul(const StackMatmul& m, const torch::Tensor& x,
                                  const c10::optional<torch::Tensor>& norm_weight, int64_t gated,
                                  const c10::optional<torch::Tensor>& residual) const {
  if (m.vectored && x.size(0) > kernel_rows_)
    return vector_gemm(x, m.weights.parts, m.weights.formats, m.bias, norm_weight, eps_, gated, residual);
  return block_quant_linear(x, m.weights.parts, m.weights.formats, m.bias, norm_weight, eps_, gated, residual);
}

torch::Tensor DecodeStack::forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const torch::Tensor& kv_cache, const std::vector<torch::Tensor>& slot_mappings,
                                   const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                                   int64_t num_layers, const c10::optional<torch::Tensor>& lora_slots) const {
  const int64_t T = hidden.size(0), D = head_dim_, H = num_heads_, KVH = num_kv_heads_;
  TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "num_layers: at most the stack's");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(1) == T && cos.size(2) == D &&
                  cos.is_contiguous() && sin.is_contiguous(), "cos, sin: contiguous (tables, T, head_dim)");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat, "hidden, cos, sin: fp32");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat || kv_cache.scalar_type() == torch::kHalf,
              "kv_cache: fp32 or fp16");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(2) == KVH && kv_cache.size(5) == D,
              "kv_cache: contiguous (slots, 2, kv_heads, blocks, block_size, head_dim)");
  TORCH_CHECK(slot_mappings.size() == windows_.size() && block_tables.size() == windows_.size(),
              "slot_mappings, block_tables: one per KV group");
  bool tiled = false, experts = false;
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers_[l];
    TORCH_CHECK(layer.slot < kv_cache.size(0) && layer.rope < cos.size(0), "a layer's slot or table is missing");
    TORCH_CHECK(layer.gated_mlp || layer.experts, "a layer without its MLP");
    experts |= static_cast<bool>(layer.experts);
    for (const StackMatmul& m : layer.matmuls) tiled |= m.vectored;
  }
  hidden = hidden.contiguous();
  const std::vector<std::vector<const LoraMatmul*>> loras = lora_rows(lora_slots, num_layers);
  TORCH_CHECK(loras.empty() || static_cast<int64_t>(loras[0].size()) == T, "lora_slots: one per token");
  if (!(T > kernel_rows_ && tiled))
    return forward_team(hidden, cos, sin, kv_cache, slot_mappings, block_tables, seq_lens, num_layers, loras);
  TORCH_CHECK(!experts, "layers with experts take at most kernel_rows tokens");
  // matmul `which` of layer l, plus the rows' adapters' deltas
  const auto adapted = [&](int64_t l, int64_t which, const torch::Tensor& x,
                           const c10::optional<torch::Tensor>& norm_weight, int64_t gated,
                           const c10::optional<torch::Tensor>& residual) {
    const StackMatmul& m = layers_[l].matmuls[which];
    if (loras.empty()) return matmul(m, x, norm_weight, gated, residual);
    // with adapters the prologue is made once, for the matmul and the adapters' A x both
    Scratch<float> transformed;
    const float* xp = rows_after_prologue(x.data_ptr<float>(), T, m.weights.K,
                                          norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr, eps_,
                                          gated, transformed);
    const torch::Tensor rows = xp == x.data_ptr<float>()
                                   ? x
                                   : torch::from_blob(const_cast<float*>(xp), {T, m.weights.K}, hidden.options());
    torch::Tensor y = matmul(m, rows, c10::nullopt, kGatedNone, residual);
    loras_->add(l, which, rows, y, *lora_slots);
    return y;
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers_[l];
    const int64_t g = layer.group;
    const torch::Tensor layer_cache = kv_cache[layer.slot];
    const torch::Tensor qkv = adapted(l, kQkv, hidden, layer.input_norm, kGatedNone, c10::nullopt);
    const torch::Tensor q = rope_write_kv(qkv, cos[layer.rope], sin[layer.rope], layer_cache, slot_mappings[g], H,
                                          false, layer.q_norm, layer.k_norm, eps_);
    const torch::Tensor attn = paged_decode_attention(q, layer_cache, block_tables[g], seq_lens, scale_, windows_[g],
                                                      softcap_).view({T, H * D});
    const int64_t width = hidden.size(1);
    const auto add_normed = [&](torch::Tensor y, const torch::Tensor& w) {
      at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        add_normed_rows(nullptr, y.data_ptr<float>(), w.data_ptr<float>(), width, static_cast<float>(eps_), t0, t1);
      });
      return hidden + y;
    };
    hidden = layer.post_attention_norm.has_value()
                 ? add_normed(adapted(l, kO, attn, c10::nullopt, kGatedNone, c10::nullopt), *layer.post_attention_norm)
                 : adapted(l, kO, attn, c10::nullopt, kGatedNone, hidden);
    const torch::Tensor gate_up = adapted(l, kGateUp, hidden, layer.mlp_norm, kGatedNone, c10::nullopt);
    hidden = layer.post_mlp_norm.has_value()
                 ? add_normed(adapted(l, kDown, gate_up, c10::nullopt, layer.gated, c10::nullopt), *layer.post_mlp_norm)
                 : adapted(l, kDown, gate_up, c10::nullopt, layer.gated, hidden);
  }
  return hidden;
}

torch::Tensor DecodeStack::forward_team(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& kv_cache, const std::vector<torch::Tensor>& slot_mappings,
                                        const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                                        int64_t num_layers,
                                        const std::vector<std::vector<const LoraMatmul*>>& loras) const {
  const int64_t T = hidden.size(0), D = head_dim_, H = num_heads_, KVH = num_kv_heads_, hidden_size = hidden.size(1);
  int64_t widest = 0, max_experts = 0, widest_expert = 0;  // the widest matmul outputs held between ops
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers_[l];
    widest = std::max({widest, layer.matmuls[kQkv].weights.N(),
                       layer.experts ? int64_t{0} : layer.matmuls[kGateUp].weights.N()});
    if (layer.experts) {
      max_experts = std::max(max_experts, layer.experts->router.size(0));
      for (const StackMatmul& m : layer.experts->matmuls) widest_expert = std::max(widest_expert, m.weights.N());
      for (const StackMatmul& m : layer.experts->shared) widest_expert = std::max(widest_expert, m.weights.N());
    }
  }
  const auto options = hidden.options();
  const torch::Tensor out = hidden.clone();  // the residual stream, updated in place
  const torch::Tensor wide = torch::empty({T, widest}, options);
  const torch::Tensor q = torch::empty({T, H, D}, options), attn = torch::empty({T, H * D}, options);
  const torch::Tensor side = torch::empty({T, hidden_size}, options);  // an output normed before its residual add
  // experts: the normed input, each routed row gathered, its gate_up and down outputs, their sum
  const int64_t max_routed = max_experts ? T * max_experts : 0;
  const torch::Tensor normed = torch::empty({max_experts ? T : 0, hidden_size}, options);
  const torch::Tensor gathered = torch::empty({max_routed, hidden_size}, options);
  const torch::Tensor expert_wide = torch::empty({max_experts ? T : 0, std::max<int64_t>(widest_expert, 1)}, options);
  const torch::Tensor expert_out = torch::empty({max_experts ? T : 0, hidden_size}, options);
  std::vector<int64_t> routed_experts(max_routed), expert_first(max_experts + 1), expert_tokens(max_routed),
      active;
  std::vector<float> routed_weights(max_routed), expert_weights(max_routed), shared_weights(T);
  int64_t lora_widest = 0;  // adapters: the widest A x held between a matmul's two LoRA phases
  for (const auto& rows : loras) lora_widest = std::max(lora_widest, lora_width(rows));
  Scratch<float> lora_u = scratch<float>(std::max<int64_t>(T * lora_widest, 1));
  // every check before the team: nothing may throw inside it
  for (const torch::Tensor& slots : slot_mappings)
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == T && slots.is_contiguous(),
                "slot_mappings: int64 (T) each");
  if (num_layers > 0) {
    TORCH_CHECK(hidden_size == layers_[0].matmuls[kQkv].weights.K, "hidden: (T, the layers' hidden size)");
    const int64_t qkv_width = layers_[0].matmuls[kQkv].weights.N();
    for (const torch::Tensor& slots : slot_mappings)
      check_rope_write_kv(wide.view(-1).narrow(0, 0, T * qkv_width).view({T, qkv_width}), cos[0], sin[0], kv_cache[0],
                          slots, H);
  }
  std::vector<DecodeAttention> attention;
  for (size_t g = 0; g < windows_.size(); ++g) {
    attention.emplace_back(H, kv_cache[0], block_tables[g], seq_lens, scale_, windows_[g], softcap_);
    TORCH_CHECK(attention.back().B == T, "seq_lens: one per token");
  }
  float* const hp = out.data_ptr<float>();
  float* const wp = wide.data_ptr<float>();
  float* const qp = q.data_ptr<float>();
  float* const ap = attn.data_ptr<float>();
  float* const sp = side.data_ptr<float>();
  const int64_t layer_bytes = kv_cache.numel() / kv_cache.size(0) * kv_cache.element_size();
  const char* const cache = static_cast<const char*>(kv_cache.data_ptr());
  const float eps = static_cast<float>(eps_);

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
    // matmul m of x (M, K) after its prologue, each thread quantizing x itself (no wait for one to); with
    // `adapters` (each row's LoRA matmul) their A x first, shared out, then each thread adds its columns' deltas
    // after its columns of the matmul
    const auto matmul = [&](const StackMatmul& m, const float* x, int64_t M, const float* norm, int64_t gated,
                            const float* residual, float* y, const std::vector<const LoraMatmul*>* adapters) {
      const LinearInput in = linear_input(x, M, m.weights.K, norm, eps_, gated, m.weights);
      const float* bias = m.bias.has_value() ? m.bias->data_ptr<float>() : nullptr;
      const int64_t width = adapters != nullptr ? lora_width(*adapters) : 0;  // the same on every thread
      if (width > 0) {
        const float* rows = in.transformed ? in.transformed.get() : x;
        share(part(M * width), [&](int64_t b, int64_t e) {
          lora_shrink(*adapters, rows, m.weights.K, lora_u.get(), width, b, e);
        });
      }
      share(part(m.weights.N()), [&](int64_t n0, int64_t n1) {
        linear_rows(in, m.weights, bias, residual, y, n0, n1);
        if (width > 0) lora_expand(*adapters, lora_u.get(), width, y, m.weights.N(), n0, n1);
      });
    };
    // layer l's matmul `which`'s rows' adapters, or none
    const auto adapters = [&](int64_t l, int64_t which) { return loras.empty() ? nullptr : &loras[4 * l + which]; };
    // the stream + RMSNorm(side) by w, for a post-norm layer
    const auto add_normed = [&](const torch::Tensor& w) {
      share(part(T), [&](int64_t t0, int64_t t1) { add_normed_rows(hp, sp, w.data_ptr<float>(), hidden_size, eps, t0, t1); });
    };
    // this thread's attention items per KV group, asked for into L2 ahead of a layer's attention
    std::vector<std::pair<int64_t, int64_t>> items;
    for (const DecodeAttention& a : attention) items.push_back(a.items_of(thread, threads));
    const auto prefetch_attention = [&](int64_t l) {
      const Layer& layer = layers_[l];
      attention[layer.group].prefetch(cache + layer.slot * layer_bytes, items[layer.group].first,
                                      items[layer.group].second);
    };
    // the mixture of experts of a layer, its output (T, hidden) into `side`
    const auto experts_mlp = [&](const Layer& layer) {
      const Experts& ex = *layer.experts;
      const int64_t E = ex.router.size(0), k = ex.top_k;
      float* const xn = normed.data_ptr<float>();
      share(part(T), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) rms_norm_row(hp + t * hidden_size, layer.mlp_norm.data_ptr<float>(),
                                                       hidden_size, eps, xn + t * hidden_size);
      });
      if (thread == 0) {  // route every token, gather each expert's rows in token order
        std::vector<float> logits(E);
        const float* router = ex.router.data_ptr<float>();
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t e = 0; e < E; ++e) logits[e] = dot_row(xn + t * hidden_size, router + e * hidden_size, hidden_size);
          route(logits.data(), E, k, ex.renormalize, routed_experts.data() + t * k, routed_weights.data() + t * k);
        }
        std::fill(expert_first.begin(), expert_first.end(), 0);
        for (int64_t i = 0; i < T * k; ++i) ++expert_first[routed_experts[i] + 1];
        for (int64_t e = 0; e < E; ++e) expert_first[e + 1] += expert_first[e];
        std::vector<int64_t> filled(expert_first.begin(), expert_first.begin() + E);
        for (int64_t i = 0; i < T * k; ++i) {  // (token, slot) pairs in token order: a stable sort by expert
          const int64_t at = filled[routed_experts[i]]++;
          expert_tokens[at] = i / k;
          expert_weights[at] = routed_weights[i];
          std::copy(xn + (i / k) * hidden_size, xn + (i / k + 1) * hidden_size,
                    gathered.data_ptr<float>() + at * hidden_size);
        }
        active.clear();
        for (int64_t e = 0; e < E; ++e)
          if (expert_first[e + 1] > expert_first[e]) active.push_back(e);
        if (ex.shared_gate.has_value())
          for (int64_t t = 0; t < T; ++t)
            shared_weights[t] = 1.f / (1.f + std::exp(-dot_row(xn + t * hidden_size, ex.shared_gate->data_ptr<float>(),
                                                                hidden_size)));
      }
      share(part(T * hidden_size), [&](int64_t b, int64_t e) { std::fill(sp + b, sp + e, 0.f); });
      float* const gw = expert_wide.data_ptr<float>();
      float* const go = expert_out.data_ptr<float>();
      const auto [c0, c1] = part(hidden_size);  // this thread's columns of the sum
      for (const int64_t e : active) {  // the same list on every thread, made before the barrier above
        const int64_t first = expert_first[e], n = expert_first[e + 1] - first;
        matmul(ex.matmuls[2 * e], gathered.data_ptr<float>() + first * hidden_size, n, nullptr, kGatedNone, nullptr,
               gw, nullptr);
        matmul(ex.matmuls[2 * e + 1], gw, n, nullptr, layer.gated, nullptr, go, nullptr);
        for (int64_t r = 0; r < n; ++r) {
          float* sum = sp + expert_tokens[first + r] * hidden_size;
          const float w = expert_weights[first + r];
          for (int64_t c = c0; c < c1; ++c) sum[c] += w * go[r * hidden_size + c];
        }
      }
      if (!ex.shared.empty()) {
        matmul(ex.shared[0], xn, T, nullptr, kGatedNone, nullptr, gw, nullptr);
        matmul(ex.shared[1], gw, T, nullptr, layer.gated, nullptr, go, nullptr);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = c0; c < c1; ++c) sp[t * hidden_size + c] += shared_weights[t] * go[t * hidden_size + c];
      }
      barrier.wait(threads);
    };
    if (num_layers > 0) prefetch_attention(0);
    for (int64_t l = 0; l < num_layers; ++l) {
      const Layer& layer = layers_[l];
      const int64_t g = layer.group;
      if (thread == 0) prefetch_kv_slots(kv_cache, layer.slot, slot_mappings[g]);
      matmul(layer.matmuls[kQkv], hp, T, layer.input_norm.data_ptr<float>(), kGatedNone, nullptr, wp,
             adapters(l, kQkv));
      const float* qn = layer.q_norm.has_value() ? layer.q_norm->data_ptr<float>() : nullptr;
      const float* kn = layer.k_norm.has_value() ? layer.k_norm->data_ptr<float>() : nullptr;
      share(part(T * (H + KVH)), [&](int64_t b, int64_t e) {
        rope_write_kv_into(wp, cos[layer.rope].data_ptr<float>(), sin[layer.rope].data_ptr<float>(),
                           slot_mappings[g].data_ptr<int64_t>(), H, kv_cache, layer.slot, qn, kn, eps, qp, b, e);
      });
      share(items[g], [&](int64_t b, int64_t e) { attention[g].attend(qp, cache + layer.slot * layer_bytes, b, e); });
      share(part(T * H), [&](int64_t b, int64_t e) { attention[g].merge(ap, b, e); });
      if (layer.post_attention_norm.has_value()) {
        matmul(layer.matmuls[kO], ap, T, nullptr, kGatedNone, nullptr, sp, adapters(l, kO));
        add_normed(*layer.post_attention_norm);
      } else {
        matmul(layer.matmuls[kO], ap, T, nullptr, kGatedNone, hp, hp, adapters(l, kO));
      }
      if (layer.experts) {
        if (l + 1 < num_layers) prefetch_attention(l + 1);
        experts_mlp(layer);
        if (layer.post_mlp_norm.has_value()) {
          add_normed(*layer.post_mlp_norm);
        } else {
          share(part(T * hidden_size), [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) hp[i] += sp[i];
          });
        }
        continue;
      }
      matmul(layer.matmuls[kGateUp], hp, T, layer.mlp_norm.data_ptr<float>(), kGatedNone, nullptr, wp,
             adapters(l, kGateUp));
      if (l + 1 < num_layers) prefetch_attention(l + 1);
      if (layer.post_mlp_norm.has_value()) {
        matmul(layer.matmuls[kDown], wp, T, nullptr, layer.gated, nullptr, sp, adapters(l, kDown));
        add_normed(*layer.post_mlp_norm);
      } else {
        matmul(layer.matmuls[kDown], wp, T, nullptr, layer.gated, hp, hp, adapters(l, kDown));
      }
    }
  }
  return out;
}
