"""CUDA paged attention through flash-attention's varlen API with block tables.

Chosen only on a CUDA device with `vllm_flash_attn` (block size 16 works) or `flash_attn` (>= 2.5;
its paged KV needs a block size that is a multiple of 256) importable. Nothing here runs in the
CPU test suite; the CPU path is engine/attention/torch_backend.py.
Cache layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), as these kernels take it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.runner.inputs import ModelInputs

try:
    from vllm_flash_attn import flash_attn_varlen_func
except ImportError:
    from flash_attn import flash_attn_varlen_func


@dataclass(slots=True)
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,)
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    cu_seqlens_k: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # (B, M) int32


class FlashAttentionBackend(AttentionBackend):
    name = "flash"

    def __init__(self, scale: float):
        self.scale = scale

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                           device=device)

    def block_dim(self) -> int:
        return 2

    def build_metadata(self, inputs: ModelInputs) -> FlashAttentionMetadata:
        device = inputs.input_ids.device
        max_blocks = max(len(t) for t in inputs.block_tables)
        tables = [t + [0] * (max_blocks - len(t)) for t in inputs.block_tables]
        cu_k = [0]
        for n in inputs.seq_lens:
            cu_k.append(cu_k[-1] + n)
        q_lens = [b - a for a, b in zip(inputs.query_start_loc, inputs.query_start_loc[1:])]

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        return FlashAttentionMetadata(inputs.slot_mapping, i32(inputs.query_start_loc), i32(cu_k),
                                      i32(inputs.seq_lens), max(q_lens), max(inputs.seq_lens), i32(tables))

    def forward(self, q, k, v, layer_cache, metadata: FlashAttentionMetadata):
        num_blocks, block_size, num_kv_heads, head_dim = layer_cache.shape[1:]
        flat = layer_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, metadata.slot_mapping, k)
        flat[1].index_copy_(0, metadata.slot_mapping, v)
        out = flash_attn_varlen_func(
            q, layer_cache[0], layer_cache[1],
            cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_seqlen_q, max_seqlen_k=metadata.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=metadata.block_tables)
        return out.reshape(q.shape[0], -1)
