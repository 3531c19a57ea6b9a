"""The paged decoder every native family runs as (engine/models/families.py describes each).

One flat ragged batch of T tokens goes through every layer; attention is the backend's, each
layer with its KV group's metadata and cache slot (engine/kv_cache/layout.py). A layer is:

    x = norm(h); q, k, v = qkv(x); q, k = q_norm(q), k_norm(k)   (q/k norms: Qwen3, Gemma 3)
    q, k = rope(q), rope(k)                                          (the layer's table; none: NoPE)
    h = h + post_norm(o(attention(q, k, v)))                         (post-norms: Gemma 2, 3)
    h = h + post_norm(mlp(norm(h)))                                  (gated MLP or experts)

Weights are copied from a loaded transformers model: q/k/v and gate/up fused into one matmul
each (Phi-3's checkpoints store them fused already), RMSNorm weights with Gemma's 1 + w folded
in, each head's dimensions permuted for partial rotary (engine/models/rope.py). Matmuls are
engine.models.linear modules (fp32, or quantized at load time), which also apply the norms, the
gated activation and the residual adds around them. A 16-bit model on CUDA instead carries each
residual to the next RMSNorm, whose Triton kernel adds it (one kernel where two ran; the same
values). Logits are computed only at sampled positions, soft-capped where the family caps them.
With every matmul block-quantized, decode steps run the whole stack in one C++ call
(engine/csrc/decode_stack.cpp), which takes every layer shape here.
"""
from __future__ import annotations

import sys
from itertools import islice
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionParams
from engine.kv_cache.layout import KVLayout
from engine.lora import DOWN, GATE_UP, OUT, QKV, Adapter, LoraBatch, StackedLoraSlots
from engine.models.families import Family
from engine.models.linear import (
    GATED_ACTIVATIONS,
    BlockQuantLinear,
    Linear,
    fused_ops,
    prologue,
    rms_norm,
    triton_ops,
)
from engine.models.mlp import Experts, GatedMLP
from engine.models.paged_model import PagedModel
from engine.models.rope import partial_rotary_permutation, rope_tables
from engine.models.windows import layer_windows

# transformers' activation names -> the gated prologues' (engine.models.linear.GATED_ACTIVATIONS)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}


def _norm(module: Any, offset: bool) -> nn.Parameter:
    """An RMSNorm's weight, Gemma's 1 + w made the weight (computed in fp32, as Gemma does)."""
    weight = module.weight.detach().float()
    return nn.Parameter(1.0 + weight if offset else weight, requires_grad=False)


class DecoderLayer(nn.Module):
    qkv: nn.Module  # a Linear, or what engine.models.linear.quantize made of it
    o: nn.Module
    mlp: GatedMLP | Experts
    input_norm: nn.Parameter
    mlp_norm: nn.Parameter
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None
    post_attention_norm: nn.Parameter | None
    post_mlp_norm: nn.Parameter | None

    def __init__(self, hf_layer, family: Family, config, layout: KVLayout, index: int, rope: int,
                 permutation: torch.Tensor | None):
        """`rope`: the layer's table in the model's; `permutation`: of each head's dimensions
        (partial rotary), or None."""
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.index, self.permutation = index, permutation
        self.cache_slot, self.kv_group, self.rope = layout.slot_of[index], layout.group_of[index], rope
        weight, bias = _qkv(attn)
        q_norm, k_norm = (_norm(attn.q_norm, family.norm_offset) if hasattr(attn, "q_norm") else None,
                          _norm(attn.k_norm, family.norm_offset) if hasattr(attn, "k_norm") else None)
        if permutation is not None:
            weight = self.permuted(weight, permutation)
            bias = None if bias is None else self.permuted(bias, permutation)
            q_norm, k_norm = (_permuted_norm(q_norm, permutation), _permuted_norm(k_norm, permutation))
        self.qkv, self.o = Linear(weight, bias), Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.input_norm = _norm(hf_layer.input_layernorm, family.norm_offset)
        if family.sandwich_norms:
            self.post_attention_norm = _norm(hf_layer.post_attention_layernorm, family.norm_offset)
            self.mlp_norm = _norm(hf_layer.pre_feedforward_layernorm, family.norm_offset)
            self.post_mlp_norm = _norm(hf_layer.post_feedforward_layernorm, family.norm_offset)
        else:
            self.post_attention_norm = self.post_mlp_norm = None
            self.mlp_norm = _norm(hf_layer.post_attention_layernorm, family.norm_offset)
        activation = ACTIVATIONS.get(getattr(config, "hidden_activation", None) or config.hidden_act)
        if activation is None:
            raise ValueError(f"activation {config.hidden_act!r}: the native decoder takes {sorted(ACTIVATIONS)}")
        self.mlp = _experts(mlp, family, config, activation) if hasattr(mlp, "experts") else _gated_mlp(mlp, activation)
        # (N, K) of qkv, o, gate_up, down: what a LoRA adapter's matrices must fit
        self.matmul_shapes = [tuple(weight.shape), tuple(attn.o_proj.weight.shape)]
        if isinstance(self.mlp, GatedMLP):
            self.matmul_shapes += self.mlp.matmul_shapes

    def permuted(self, qkv: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
        """qkv's q and k rows (or biases) with each head's dimensions in `permutation`'s order."""
        num_qk, d = self.num_heads + self.num_kv_heads, self.head_dim
        qk = qkv[:num_qk * d].reshape(num_qk, d, *qkv.shape[1:])[:, permutation].reshape(num_qk * d, *qkv.shape[1:])
        return torch.cat([qk, qkv[num_qk * d:]])

    def forward(self, hidden, cos, sin, layer_cache, backend: AttentionBackend, metadata,
                loras: LoraBatch | None = None):
        """hidden (T, hidden); cos/sin (T, head_dim) of the layer's table at the tokens' positions;
        `loras`: the rows' adapters, if any."""
        # (T, (heads + 2 kv_heads) * d)
        qkv = self._matmul(QKV, self.qkv, hidden, loras, norm=(self.input_norm, self.eps))
        attn = self._attention(qkv, cos, sin, layer_cache, backend, metadata)
        if self.post_attention_norm is None:
            hidden = self._matmul(OUT, self.o, attn, loras, residual=hidden)
        else:
            hidden = hidden + rms_norm(self._matmul(OUT, self.o, attn, loras), self.post_attention_norm, self.eps)
        return self._mlp(hidden, loras)

    def _matmul(self, which: int, linear: nn.Module, x, loras: LoraBatch | None, norm=None, gated=None,
                residual=None):
        """residual + linear(prologue(x)), plus the rows' adapters' deltas for matmul `which`."""
        if loras is None:
            return linear(x, norm=norm, gated=gated, residual=residual)
        x = prologue(x, norm, gated)
        out = linear(x)
        loras.add(self.index, which, x, out)
        return out if residual is None else residual + out

    def _mlp(self, hidden, loras: LoraBatch | None):
        if isinstance(self.mlp, GatedMLP):
            gate_up = self._matmul(GATE_UP, self.mlp.gate_up, hidden, loras, norm=(self.mlp_norm, self.eps))
            if self.post_mlp_norm is None:
                return self._matmul(DOWN, self.mlp.down, gate_up, loras, gated=self.mlp.activation, residual=hidden)
            out = self._matmul(DOWN, self.mlp.down, gate_up, loras, gated=self.mlp.activation)
        else:
            out = self.mlp(rms_norm(hidden, self.mlp_norm, self.eps))
        return hidden + (out if self.post_mlp_norm is None else rms_norm(out, self.post_mlp_norm, self.eps))

    def forward_carrying_residual(self, hidden, residual, cos, sin, layer_cache, backend: AttentionBackend,
                                  metadata, ops):
        """forward, each residual add done by the RMSNorm kernel after it (`ops`: engine.models.cuda_ops):
        the layer's input is hidden + residual (None: hidden alone), and so is its output."""
        if residual is None:
            residual, normed = hidden, ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            residual, normed = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        out = self.o(self._attention(self.qkv(normed), cos, sin, layer_cache, backend, metadata))
        if self.post_attention_norm is not None:
            out = ops.rms_norm(out, self.post_attention_norm, self.eps)
        residual, normed = ops.add_rms_norm(out, residual, self.mlp_norm, self.eps)
        out = self.mlp(normed)
        if self.post_mlp_norm is not None:
            out = ops.rms_norm(out, self.post_mlp_norm, self.eps)
        return out, residual

    def _attention(self, qkv, cos, sin, layer_cache, backend: AttentionBackend, metadata):
        num_tokens, num_qk, d = qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim
        norms = None if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm, self.eps)
        qk = backend.rope_and_write(qkv, cos, sin, layer_cache, metadata, self.num_heads, norms)
        if qk is None and norms is not None:  # each q and k head RMS-normed before RoPE, here
            q = rms_norm(qkv[:, :self.num_heads * d].view(num_tokens, -1, d), norms[0], self.eps)
            k = rms_norm(qkv[:, self.num_heads * d:num_qk * d].view(num_tokens, -1, d), norms[1], self.eps)
            qkv = torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1), qkv[:, num_qk * d:]], dim=1)
            qk = backend.rope_and_write(qkv, cos, sin, layer_cache, metadata, self.num_heads)
        written = qk is not None
        if qk is None:
            qk = _rope(qkv[:, :num_qk * d].view(num_tokens, num_qk, d), cos[:, None], sin[:, None])
        v = qkv[:, num_qk * d:].view(num_tokens, self.num_kv_heads, d)
        return backend.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v, layer_cache, metadata, written)


def _qkv(attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q/k/v's weights (and biases) stacked: one stored fused (Phi-3), or three concatenated."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.weight.detach(), None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach()
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [p.bias for p in projections]
    return (torch.cat([p.weight.detach() for p in projections]),
            torch.cat([b.detach() for b in biases]) if biases[0] is not None else None)


def _gated_mlp(mlp, activation: str) -> GatedMLP:
    if hasattr(mlp, "gate_up_proj"):  # stored fused (Phi-3)
        return GatedMLP(mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach(), activation)
    gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
    return GatedMLP(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
                    mlp.down_proj.weight.detach(), activation, gate_up_bias,
                    None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach())


def _experts(mlp, family: Family, config, activation: str) -> Experts:
    """transformers' sparse MoE block (router `gate`, stacked `experts`, optional `shared_expert`)."""
    renormalize = family.renormalize_experts
    if renormalize is None:
        renormalize = bool(config.norm_topk_prob)
    shared = getattr(mlp, "shared_expert", None)
    return Experts(mlp.gate.weight.detach(), mlp.experts.gate_up_proj.detach(), mlp.experts.down_proj.detach(),
                   activation, mlp.gate.top_k, renormalize, None if shared is None else _gated_mlp(shared, activation),
                   None if shared is None else mlp.shared_expert_gate.weight.detach())


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, d); cos/sin (T, 1, d) with sin's first half negated: rotate_half as a roll."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class PagedDecoder(PagedModel):
    model_path = "native"
    cos: torch.Tensor
    sin: torch.Tensor
    embed_scale: torch.Tensor | None

    def __init__(self, hf_model, family: Family, max_model_len: int):
        super().__init__()
        config = hf_model.config
        body = hf_model.model
        self.architecture = type(hf_model).__name__
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size  # an embedding's size
        self.eps = config.rms_norm_eps
        windows = layer_windows(config, [layer.self_attn for layer in body.layers])
        self.kv_layout = KVLayout.for_windows(windows, max_model_len)
        query_scale = getattr(config, family.query_scale_field) if family.query_scale_field else self.head_dim
        softcap = getattr(config, family.attention_softcap_field) if family.attention_softcap_field else None
        self.attention = AttentionParams(query_scale ** -0.5, softcap or None)
        final_softcap = getattr(config, family.final_softcap_field) if family.final_softcap_field else None
        self.final_softcap = final_softcap or None
        # (vocab, hidden); a GGUF's quantized table stays in its blocks (engine/models/gguf_blocks.py BlockEmbedding)
        self.embed: nn.Module = nn.Embedding.from_pretrained(body.embed_tokens.weight.detach(), freeze=True)
        scale = torch.tensor(config.hidden_size ** 0.5) if family.embed_scale else None
        self.register_buffer("embed_scale", scale, persistent=False)  # rounded to the model's dtype with it
        kinds = _rope_kinds(hf_model)
        distinct = list(dict.fromkeys(kinds))
        cos, sin, rotary_dim = rope_tables(body.rotary_emb, config, distinct, self.head_dim, max_model_len)
        self.register_buffer("cos", cos, persistent=False)  # (tables, max_len, d)
        self.register_buffer("sin", sin, persistent=False)
        permutation = partial_rotary_permutation(self.head_dim, rotary_dim) if rotary_dim < self.head_dim else None
        self.layers: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]  # registered, typed as a list
            DecoderLayer(layer, family, config, self.kv_layout, i, distinct.index(kind), permutation)
            for i, (layer, kind) in enumerate(zip(body.layers, kinds)))
        self.norm = _norm(body.norm, family.norm_offset)
        self.lm_head = Linear(hf_model.lm_head.weight)
        self.decode_stack, self.decode_rows = None, 0  # set by fuse_decode_stack
        self.lora_slots = None  # the C++ kernels' LoRA slots, made with the first adapter installed

    def fuse_decode_stack(self, kernels: Any) -> str | None:
        """With every layer's matmuls block-quantized, decode steps of up to their `decode_rows` tokens
        (of any count where every matmul is `vectored` and no layer has experts: the stack runs the
        vector GEMM past them) run the whole stack in one C++ call (engine/csrc/decode_stack.cpp),
        the same kernels without the per-op overhead of the layers' Python. Returns why not, if not."""
        dense = [m for layer in self.layers for m in (layer.qkv, layer.o)
                 + ((layer.mlp.gate_up, layer.mlp.down) if isinstance(layer.mlp, GatedMLP) else ())]
        experts = [m for layer in self.layers if isinstance(layer.mlp, Experts)
                   for mlp in (*layer.mlp.experts, *filter(None, [layer.mlp.shared])) for m in (mlp.gate_up, mlp.down)]
        if not all(isinstance(m, BlockQuantLinear) for m in dense + experts):
            return "not every matmul is block-quantized"
        kernel_rows = min(_block_quant(m).decode_rows for m in dense + experts)
        vectored = not experts and all(_block_quant(m).vectored and _block_quant(m).decode_rows == kernel_rows
                                       for m in dense)
        stack = kernels.DecodeStack(self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.attention.scale,
                                    self.attention.softcap or 0.0, [w or 0 for w in self.kv_layout.windows],
                                    kernel_rows)
        for index, layer in enumerate(self.layers):
            matmuls = [_block_quant(m) for m in [layer.qkv, layer.o] + (
                [layer.mlp.gate_up, layer.mlp.down] if isinstance(layer.mlp, GatedMLP) else [])]
            stack.add_layer([m.part_rows for m in matmuls], [m.formats for m in matmuls], [m.bias for m in matmuls],
                            [layer.input_norm, layer.mlp_norm, layer.post_attention_norm, layer.post_mlp_norm,
                             layer.q_norm, layer.k_norm], GATED_ACTIVATIONS[_activation(layer)], layer.cache_slot,
                            layer.kv_group, layer.rope)
            if isinstance(layer.mlp, Experts):
                mlp = layer.mlp
                parts = [_block_quant(m) for expert in mlp.experts for m in (expert.gate_up, expert.down)]
                shared = [] if mlp.shared is None else [_block_quant(mlp.shared.gate_up), _block_quant(mlp.shared.down)]
                stack.add_experts(mlp.router, [m.part_rows for m in parts], [m.formats for m in parts], mlp.top_k,
                                  mlp.renormalize, [m.part_rows for m in shared], [m.formats for m in shared],
                                  mlp.shared_gate)
            elif vectored:
                for which in range(len(matmuls)):
                    stack.use_vector_gemm(index, which)
        self.decode_rows = sys.maxsize if vectored else kernel_rows
        self.decode_stack = stack
        return None

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, backend: AttentionBackend, metadata: list, sample_indices,
                num_layers: int | None = None, pooled_indices=None, loras: LoraBatch | None = None):
        """Returns logits (R, vocab) for the tokens at sample_indices; `metadata`: per KV group the
        backend's; `num_layers`: through the first layers only (a self-draft), then the final norm
        and LM head. With `pooled_indices`: (logits, the final norm's output at those tokens).
        `loras`: the rows' LoRA adapters (installed with install_lora), if any row has one."""
        hidden = self.embed(input_ids)  # (T, hidden)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        cos, sin = self.cos[:, positions], self.sin[:, positions]  # (tables, T, d)
        stack_args = None
        if self.decode_stack is not None and input_ids.shape[0] <= self.decode_rows:
            stack_args = backend.decode_stack_args(metadata)
        layers = islice(self.layers, num_layers)
        if loras is not None and self.lora_slots is not None:
            loras.kernel = self.lora_slots
            loras.slots = loras.slots.to(hidden.device, non_blocking=True)
        if stack_args is not None:
            slots, tables, lens = zip(*stack_args)
            hidden = self.decode_stack.forward(hidden, cos, sin, kv_cache, list(slots), list(tables), lens[0],
                                               num_layers or self.num_layers, None if loras is None else loras.slots)
        elif (ops := fused_ops(hidden)) is not None and loras is None:
            residual = None
            for layer in layers:
                hidden, residual = layer.forward_carrying_residual(
                    hidden, residual, cos[layer.rope], sin[layer.rope], kv_cache[layer.cache_slot], backend,
                    metadata[layer.kv_group], ops)
            assert residual is not None  # a model has layers
            _, normed = ops.add_rms_norm(hidden[sample_indices], residual[sample_indices], self.norm, self.eps)
            logits = self._capped(self.lm_head(normed))
            if pooled_indices is None:
                return logits
            return logits, ops.add_rms_norm(hidden[pooled_indices], residual[pooled_indices], self.norm, self.eps)[1]
        else:
            for layer in layers:
                hidden = layer(hidden, cos[layer.rope], sin[layer.rope], kv_cache[layer.cache_slot], backend,
                               metadata[layer.kv_group], loras)
        logits = self._capped(self.lm_head(hidden[sample_indices], norm=(self.norm, self.eps)))
        if pooled_indices is None:
            return logits
        return logits, rms_norm(hidden[pooled_indices], self.norm, self.eps)

    def _lora_slots(self, num_slots: int):
        """Where adapters' products run: the C++ kernels' LoraSlots (an fp32 model on a CPU they
        load on; the decode stack reads them too), the Triton kernels' StackedLoraSlots (a model on
        CUDA with Triton), else None (each step's LoraBatch carries them to torch's ops)."""
        device, dtype = self.norm.device, self.norm.dtype
        if device.type == "cpu" and dtype == torch.float32:
            from engine.cpu_kernels import load_cpu_kernels

            kernels = load_cpu_kernels()
            return None if kernels is None else kernels.LoraSlots(self.num_layers)
        if device.type == "cuda" and triton_ops() is not None:
            return StackedLoraSlots(num_slots, device, dtype)
        return None

    def install_lora(self, adapter: Adapter, num_slots: int) -> None:
        """Puts the adapter's weights in its slot (of `num_slots`) where the kernels read them."""
        if self.lora_slots is None:
            self.lora_slots = self._lora_slots(num_slots)
            if self.decode_stack is not None and self.lora_slots is not None:
                self.decode_stack.use_lora(self.lora_slots)
        if self.lora_slots is None:
            return
        for index, matmuls in enumerate(adapter.matmuls):
            for which, m in enumerate(matmuls):
                if m is not None:
                    self.lora_slots.set(adapter.slot, index, which, m.a, list(m.b),
                                        torch.tensor(m.segments, dtype=torch.long).view(-1, 4),
                                        self.layers[index].matmul_shapes[which][0])

    def uninstall_lora(self, adapter: Adapter) -> None:
        if self.lora_slots is not None:
            self.lora_slots.clear(adapter.slot)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


def _permuted_norm(norm: nn.Parameter | None, permutation: torch.Tensor) -> nn.Parameter | None:
    return None if norm is None else nn.Parameter(norm[permutation], requires_grad=False)


def _block_quant(matmul: nn.Module) -> BlockQuantLinear:
    if not isinstance(matmul, BlockQuantLinear):
        raise TypeError(f"a {type(matmul).__name__} in the fused decode stack")
    return matmul


def _activation(layer: DecoderLayer) -> str:
    mlp = layer.mlp
    return mlp.activation if isinstance(mlp, GatedMLP) else mlp.experts[0].activation


def _rope_kinds(hf_model) -> list[str | None]:
    """Each layer's RoPE table: its layer type where the rotary module takes one (Gemma 3), None
    for a layer without RoPE (SmolLM3's NoPE layers), else one table for all."""
    config = hf_model.config
    by_type = isinstance(getattr(hf_model.model.rotary_emb, "rope_type", None), dict)
    kinds: list[str | None] = []
    for index, layer in enumerate(hf_model.model.layers):
        if not getattr(layer.self_attn, "use_rope", True):
            kinds.append(None)
        else:
            kinds.append(config.layer_types[index] if by_type else "default")
    return kinds
