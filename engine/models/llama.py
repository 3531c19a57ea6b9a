"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) written for paged attention.

One flat ragged batch of T tokens goes through every layer; attention is the backend's. Weights
are copied from a loaded transformers model, with q/k/v and gate/up fused into one matmul each;
matmuls are engine.models.linear modules (fp32, or quantized at load time), which also apply the
norms, the SwiGLU and the residual adds around them. A 16-bit model on CUDA instead carries each
residual to the next RMSNorm, whose Triton kernel adds it (one kernel where two ran; the same
values). RoPE tables come from
the transformers model's own rotary embedding, so its rope scaling (llama3, linear, yarn, ...) is
reproduced exactly. Logits are computed only at sampled positions.
"""
from __future__ import annotations

import sys
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.models.linear import BlockQuantLinear, Linear, fused_ops


class LlamaLayer(nn.Module):
    def __init__(self, hf_layer, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        self.qkv = Linear(torch.cat([p.weight.detach() for p in projections]),
                          torch.cat([b.detach() for b in biases]) if biases[0] is not None else None)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = Linear(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]))
        self.down = Linear(mlp.down_proj.weight)
        self.input_norm = nn.Parameter(hf_layer.input_layernorm.weight.detach(), requires_grad=False)
        self.post_norm = nn.Parameter(hf_layer.post_attention_layernorm.weight.detach(), requires_grad=False)

    def forward(self, hidden, cos, sin, layer_cache, backend: AttentionBackend, metadata):
        """cos/sin (T, head_dim) at the tokens' positions."""
        qkv = self.qkv(hidden, norm=(self.input_norm, self.eps))  # (T, (heads + 2 kv_heads) * d)
        hidden = self.o(self._attention(qkv, cos, sin, layer_cache, backend, metadata), residual=hidden)
        gate_up = self.gate_up(hidden, norm=(self.post_norm, self.eps))
        return self.down(gate_up, swiglu=True, residual=hidden)

    def forward_carrying_residual(self, hidden, residual, cos, sin, layer_cache, backend: AttentionBackend,
                                  metadata, ops):
        """forward, each residual add done by the RMSNorm kernel after it (`ops`: engine.models.cuda_ops):
        the layer's input is hidden + residual (None: hidden alone), and so is its output."""
        if residual is None:
            residual, normed = hidden, ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            residual, normed = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        attn = self._attention(self.qkv(normed), cos, sin, layer_cache, backend, metadata)
        residual, normed = ops.add_rms_norm(self.o(attn), residual, self.post_norm, self.eps)
        return self.down(self.gate_up(normed), swiglu=True), residual

    def _attention(self, qkv, cos, sin, layer_cache, backend: AttentionBackend, metadata):
        num_tokens, num_qk = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = backend.rope_and_write(qkv, cos, sin, layer_cache, metadata, self.num_heads)
        written = qk is not None
        if not written:
            qk = _rope(qkv[:, :num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim), cos[:, None],
                       sin[:, None])
        v = qkv[:, num_qk * self.head_dim:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return backend.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v, layer_cache, metadata, written)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, d); cos/sin (T, 1, d) with sin's first half negated: rotate_half as a roll."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class LlamaForPagedAttention(nn.Module):
    def __init__(self, hf_model, max_model_len: int):
        super().__init__()
        config = hf_model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        body = hf_model.model
        self.embed = nn.Parameter(body.embed_tokens.weight.detach(), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(layer, self.num_heads, self.num_kv_heads, self.head_dim, self.eps)
                                    for layer in body.layers)
        self.norm = nn.Parameter(body.norm.weight.detach(), requires_grad=False)
        self.lm_head = Linear(hf_model.lm_head.weight)
        cos, sin = _rope_tables(body.rotary_emb, max_model_len, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.decode_stack, self.decode_rows = None, 0  # set by fuse_decode_stack

    def fuse_decode_stack(self, kernels) -> None:
        """With every layer's matmuls block-quantized, decode steps of up to their `decode_rows` tokens
        (of any count where every matmul is `vectored`: the stack runs the vector GEMM past them)
        run the whole stack in one C++ call (engine/csrc/decode_stack.cpp), the same kernels
        without the per-op overhead of the layers' Python."""
        matmuls = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not all(isinstance(m, BlockQuantLinear) for m in matmuls):
            return
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        kernel_rows = min(m.decode_rows for m in matmuls)
        vectored = all(m.vectored and m.decode_rows == kernel_rows for m in matmuls)
        self.decode_rows = sys.maxsize if vectored else kernel_rows
        tiles = [(m.tiles, m.scales, m.offsets) if vectored else (None, None, None) for m in matmuls]
        self.decode_stack = kernels.DecodeStack([m.rows for m in matmuls], [m.format for m in matmuls],
                                                [m.bias for m in matmuls], norms, self.num_heads,
                                                self.num_kv_heads, self.head_dim, self.eps, *map(list, zip(*tiles)),
                                                kernel_rows)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, backend: AttentionBackend, metadata, sample_indices,
                num_layers: int | None = None):
        """Returns logits (R, vocab) for the tokens at sample_indices; `num_layers`: through the
        first layers only (a self-draft), then the final norm and LM head."""
        hidden = F.embedding(input_ids, self.embed)  # (T, hidden)
        cos, sin = self.cos[positions], self.sin[positions]  # (T, d)
        stack_args = None
        if self.decode_stack is not None and input_ids.shape[0] <= self.decode_rows:
            stack_args = backend.decode_stack_args(metadata)
        layers = zip(islice(self.layers, num_layers), kv_cache)
        if stack_args is not None:
            hidden = self.decode_stack.forward(hidden, cos, sin, kv_cache, *stack_args, num_layers or self.num_layers)
        elif (ops := fused_ops(hidden)) is not None:
            residual = None
            for layer, layer_cache in layers:
                hidden, residual = layer.forward_carrying_residual(hidden, residual, cos, sin, layer_cache, backend,
                                                                   metadata, ops)
            _, normed = ops.add_rms_norm(hidden[sample_indices], residual[sample_indices], self.norm, self.eps)
            return self.lm_head(normed)
        else:
            for layer, layer_cache in layers:
                hidden = layer.forward(hidden, cos, sin, layer_cache, backend, metadata)
        return self.lm_head(hidden[sample_indices], norm=(self.norm, self.eps))  # the final norm: its prologue


@torch.no_grad()
def _rope_tables(rotary_emb, max_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (max_len, d) from transformers' rotary module, sin's first half negated."""
    positions = torch.arange(max_len)[None]
    probe = torch.zeros(1, 1, head_dim, dtype=torch.float32)
    cos, sin = rotary_emb(probe, positions)
    cos, sin = cos[0].float(), sin[0].float()
    sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2:]], dim=-1)
    return cos, sin
