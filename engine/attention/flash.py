"""CUDA attention through the FlashAttention-2 kernel that ships inside torch (varlen, GQA
native, causal aligned to each sequence's end so a chunk attends to its cached context).

Each step gathers every scheduled request's context (its cached tokens and the step's new ones)
from the paged cache into one packed (sum of context lengths, kv_heads, head_dim) pair, then runs
one varlen kernel over the whole ragged batch: prefill chunks and decodes together. The gather is
a copy of the batch's context per layer; a kernel that reads block tables in place would skip it.
A sliding-window group's layers pass their window to the kernel (keys before it are gathered
but not read). The kernel has no score soft-cap: the selector keeps soft-capped models off it.
Cache layout: BlockMajorCache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BlockMajorCache
from engine.batch import GroupTables, ModelInputs, host_tensor, padded_rows


@dataclass(slots=True)
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) where the step's new keys go
    context_slots: torch.Tensor  # (sum seq_lens,) every request's context, in order
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    cu_seqlens_k: torch.Tensor  # (B + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    window: int | None  # the KV group's sliding window


class FlashAttentionBackend(BlockMajorCache, AttentionBackend):
    name = "flash"

    def group_metadata(self, inputs: ModelInputs, group: GroupTables) -> FlashAttentionMetadata:
        device, block_size = inputs.input_ids.device, inputs.block_size
        # a sliding group's dropped entries are never read (they lie before its window): block 0 stands in
        tables = padded_rows([[max(b, 0) for b in table] for table in group.block_tables], 0).to(device)
        seq_lens = host_tensor(inputs.seq_lens).to(device)
        cu_k = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0))
        request = torch.repeat_interleave(torch.arange(len(inputs.seq_lens), device=device), seq_lens)
        position = torch.arange(request.numel(), device=device) - cu_k[request]
        context_slots = tables[request, position // block_size] * block_size + position % block_size
        q_lens = [b - a for a, b in zip(inputs.query_start_loc, inputs.query_start_loc[1:])]
        return FlashAttentionMetadata(
            group.slot_mapping, context_slots,
            torch.tensor(inputs.query_start_loc, dtype=torch.int32, device=device), cu_k.to(torch.int32),
            max(q_lens), max(inputs.seq_lens), group.window)

    def forward(self, q, k, v, layer_cache, metadata: FlashAttentionMetadata, kv_written: bool = False):
        if not kv_written:
            self.write_kv(layer_cache, metadata.slot_mapping, k, v)
        flat = layer_cache.view(2, -1, *layer_cache.shape[-2:])
        keys = flat[0].index_select(0, metadata.context_slots)
        values = flat[1].index_select(0, metadata.context_slots)
        out = torch.ops.aten._flash_attention_forward(
            q, keys, values, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
            metadata.max_seqlen_k, 0.0, True, False, scale=self.scale,
            **({} if metadata.window is None else {"window_size_left": metadata.window - 1, "window_size_right": 0}))[0]
        return out.reshape(q.shape[0], -1)
