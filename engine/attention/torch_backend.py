"""Paged attention in plain torch: runs on any device, tuned for CPU.

Cache layout per layer: (2, num_kv_heads, num_blocks, block_size, head_dim). Gathering a batch's
blocks along dim 2 then yields (2, num_kv_heads, B, L, head_dim) with no transpose copy, so decode
attention is two batched matmuls over (kv_head, request). Decodes are grouped by context length
(buckets) to bound the padding each gather reads; prefill chunks attend one request at a time
with SDPA (a chunk with no cached context attends to its own keys and skips the gather).
With the C++ kernel (engine/cpu_kernels.py) decodes skip the gather: it reads blocks in place.
Gathers write into one reusable workspace: a fresh multi-MB tensor per layer costs more in page
faults than the copy itself. A sliding-window group's queries gather only the blocks from the
first one their window reads, and mask the keys before the window; with a score soft-cap,
attention is computed in float32 matmuls (SDPA has no cap), as transformers' eager attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionParams, zeroed_pool
from engine.batch import GroupTables, ModelInputs, host_tensor, padded_rows

_BUCKET_GROWTH = 1.5  # a decode bucket's longest context is at most this times its shortest


@dataclass(slots=True)
class DecodeBucket:
    token_start: int  # first flat token (= request) index of the bucket
    token_end: int
    block_tables: torch.Tensor  # (Bb, M) each row's blocks from the first its window reads, padded with block 0
    mask: torch.Tensor  # (1, Bb, 1, M * block_size) additive: 0 where a key is read, -inf elsewhere


@dataclass(slots=True)
class PrefillChunk:
    token_start: int
    token_end: int
    block_ids: torch.Tensor | None  # blocks holding the keys read, None: the chunk reads only its own keys
    mask: torch.Tensor | None  # (n, keys) bool: query i sees key j; None: causal over its own keys


@dataclass(slots=True)
class KernelDecodeBatch:
    """All single-token queries, for the C++ kernel (it reads exact lengths: no padding cost)."""
    num_tokens: int
    block_tables: torch.Tensor  # (Bd, M) padded with block 0
    seq_lens: torch.Tensor  # (Bd,)


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    window: int | None  # the KV group's sliding window
    decode_buckets: list[DecodeBucket]  # pure-torch decode path
    kernel_decodes: KernelDecodeBatch | None  # C++ decode path
    prefills: list[PrefillChunk]


def _first_key(position: int, window: int | None) -> int:
    """The first position a query at `position` reads."""
    return 0 if window is None else max(0, position - window + 1)


def _kernel_decodes(inputs: ModelInputs, group: GroupTables, device: torch.device) -> KernelDecodeBatch | None:
    if inputs.num_decodes == 0:
        return None
    return KernelDecodeBatch(inputs.num_decodes, padded_rows(group.block_tables[:inputs.num_decodes], 0).to(device),
                             host_tensor(inputs.seq_lens[:inputs.num_decodes]).to(device))


def _decode_buckets(inputs: ModelInputs, group: GroupTables, device: torch.device) -> list[DecodeBucket]:
    """Splits the decode block (sorted by context length in the inputs) into buckets of similar
    spans (the keys each row reads: its window, or its whole context)."""
    bs, window, buckets, first = inputs.block_size, group.window, [], 0
    lens = inputs.seq_lens[:inputs.num_decodes]
    first_blocks = [_first_key(n - 1, window) // bs for n in lens]
    spans = [n - b * bs for n, b in zip(lens, first_blocks)]
    for i in range(1, len(lens) + 1):
        if i < len(lens) and spans[i] <= _BUCKET_GROWTH * spans[first] + bs:
            continue
        max_blocks = -(-max(spans[first:i]) // bs)
        key_pos = (torch.tensor(first_blocks[first:i], device=device)[:, None] * bs
                   + torch.arange(max_blocks * bs, device=device)[None, :])
        seq_lens = torch.tensor(lens[first:i], device=device)[:, None]
        valid = key_pos < seq_lens
        if window is not None:
            valid &= key_pos >= seq_lens - window
        mask = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))
        rows = [table[b:] for table, b in zip(group.block_tables[first:i], first_blocks[first:i])]
        tables = padded_rows(rows, 0, width=max_blocks).to(device)
        buckets.append(DecodeBucket(first, i, tables, mask[None, :, None, :]))
        first = i
    return buckets


def _prefill_chunks(inputs: ModelInputs, group: GroupTables, device: torch.device) -> list[PrefillChunk]:
    chunks, bs, window = [], inputs.block_size, group.window
    for b in range(inputs.num_decodes, len(inputs.seq_lens)):
        start, seq_len = inputs.start_positions[b], inputs.seq_lens[b]
        t0, t1 = inputs.query_start_loc[b], inputs.query_start_loc[b + 1]
        if start == 0 and (window is None or seq_len <= window):
            chunks.append(PrefillChunk(t0, t1, None, None))
            continue
        first_block = _first_key(start, window) // bs
        q_pos = torch.arange(start, seq_len, device=device)[:, None]
        if start == 0:  # its own keys, past its window
            key_pos, blocks = torch.arange(seq_len, device=device)[None, :], None
        else:
            key_pos = torch.arange(first_block * bs, seq_len, device=device)[None, :]
            blocks = host_tensor(group.block_tables[b][first_block: -(-seq_len // bs)]).to(device)
        mask = key_pos <= q_pos
        if window is not None:
            mask &= key_pos > q_pos - window
        chunks.append(PrefillChunk(t0, t1, blocks, mask))
    return chunks


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """A chunk's own keys or values as the cache holds them (rounded to an fp16 cache's precision):
    a prompt attends to the same values whether it is prefilled whole or in chunks that read the
    earlier ones back from the cache, so how a batch splits it does not change its tokens."""
    return x if cache_dtype == x.dtype else x.to(cache_dtype).to(x.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, params: AttentionParams, decode_kernel=None):
        super().__init__(params)
        self.decode_kernel = decode_kernel  # engine.cpu_kernels module, or None
        self._workspace = torch.empty(0)

    def allocate_kv_cache(self, num_slots, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        return zeroed_pool((num_slots, 2, num_kv_heads, num_blocks, block_size, head_dim), dtype, device)

    def _gather(self, layer_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks of one layer -> (2, kv_heads, len(block_ids) * block_size, head_dim), in the
        workspace: valid until the next gather."""
        _, num_kv_heads, num_blocks, block_size, head_dim = layer_cache.shape
        numel = 2 * num_kv_heads * block_ids.numel() * block_size * head_dim
        if self._workspace.numel() < numel or self._workspace.dtype != layer_cache.dtype:
            self._workspace = torch.empty(numel, dtype=layer_cache.dtype, device=layer_cache.device)
        out = self._workspace[:numel].view(2 * num_kv_heads, block_ids.numel(), block_size * head_dim)
        torch.index_select(layer_cache.view(2 * num_kv_heads, num_blocks, -1), 1, block_ids, out=out)
        return out.view(2, num_kv_heads, -1, head_dim)

    def block_dim(self) -> int:
        return 3

    def group_metadata(self, inputs: ModelInputs, group: GroupTables) -> TorchAttentionMetadata:
        device = inputs.input_ids.device
        if self.decode_kernel is not None:
            return TorchAttentionMetadata(group.slot_mapping, group.window, [], _kernel_decodes(inputs, group, device),
                                          _prefill_chunks(inputs, group, device))
        return TorchAttentionMetadata(group.slot_mapping, group.window, _decode_buckets(inputs, group, device), None,
                                      _prefill_chunks(inputs, group, device))

    def rope_and_write(self, qkv, cos, sin, layer_cache, metadata: TorchAttentionMetadata, num_heads, qk_norms=None):
        """With the C++ kernels: q/k norms, RoPE, the stack and transpose of k and v, and the slot
        write are one call (engine/csrc/rope_kv.cpp) instead of five ops a layer (eight with the
        norms), rounding as they do (the norms in the kernels' RMSNorm, as the decode stack)."""
        if self.decode_kernel is None:
            return None
        q_norm, k_norm, eps = qk_norms or (None, None, 0.0)
        return self.decode_kernel.rope_write_kv(qkv, cos, sin, layer_cache, metadata.slot_mapping, num_heads, True,
                                                q_norm, k_norm, eps)

    def forward(self, q, k, v, layer_cache, metadata: TorchAttentionMetadata, kv_written: bool = False):
        num_kv_heads, num_blocks, block_size, head_dim = layer_cache.shape[1:]
        if not kv_written:  # (2, kv_heads, T, head_dim) written into flat slots
            flat = layer_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
            flat.index_copy_(2, metadata.slot_mapping, torch.stack((k, v)).transpose(1, 2).to(layer_cache.dtype))
        outputs = [self._decode(q, layer_cache, b) for b in metadata.decode_buckets]
        batch = metadata.kernel_decodes
        if batch is not None:
            outputs.append(self.decode_kernel.paged_decode_attention(
                q[:batch.num_tokens], layer_cache, batch.block_tables, batch.seq_lens, self.scale,
                metadata.window or 0, self.softcap or 0.0))
        outputs += [self._prefill(q, k, v, layer_cache, c) for c in metadata.prefills]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out.reshape(q.shape[0], -1)

    def decode_stack_args(self, metadata: list[TorchAttentionMetadata]):
        args = []
        for group in metadata:
            batch = group.kernel_decodes
            if batch is None or group.prefills or batch.num_tokens != group.slot_mapping.numel():
                return None
            args.append((group.slot_mapping, batch.block_tables, batch.seq_lens))
        return args

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _decode(self, q, layer_cache, bucket: DecodeBucket) -> torch.Tensor:
        num_kv_heads, head_dim = layer_cache.shape[1], layer_cache.shape[-1]
        num_requests = bucket.block_tables.shape[0]
        # (2, kv_heads, Bb * L, head_dim) -> (2, kv_heads, Bb, L, head_dim)
        kv = self._gather(layer_cache, bucket.block_tables.view(-1)).view(2, num_kv_heads, num_requests, -1, head_dim)
        # (Bb, heads, d) -> (kv_heads, Bb, group, d)
        qb = q[bucket.token_start:bucket.token_end].view(num_requests, num_kv_heads, -1, head_dim).transpose(0, 1)
        if qb.dtype != torch.float32 or kv.dtype != torch.float32:  # scores and softmax in float32, as
            qb, kv = qb.float(), kv.float()  # the fused SDPA kernels compute them
        scores = self._capped(torch.matmul(qb, kv[0].transpose(-1, -2)).mul_(self.scale)).add_(bucket.mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), kv[1])  # (kv_heads, Bb, group, d)
        return out.transpose(0, 1).reshape(num_requests, -1, head_dim).to(q.dtype)

    def _prefill(self, q, k, v, layer_cache, chunk: PrefillChunk) -> torch.Tensor:
        qc = q[chunk.token_start:chunk.token_end].transpose(0, 1)[None]  # (1, heads, n, d)
        if chunk.block_ids is None:
            kc = _as_cached(k[chunk.token_start:chunk.token_end].transpose(0, 1)[None], layer_cache.dtype)
            vc = _as_cached(v[chunk.token_start:chunk.token_end].transpose(0, 1)[None], layer_cache.dtype)
        else:
            assert chunk.mask is not None  # keys read from blocks come with their mask
            kv = self._gather(layer_cache, chunk.block_ids)[:, :, :chunk.mask.shape[1]].to(q.dtype)
            kc, vc = kv[0][None], kv[1][None]
        return self._attend(qc, kc, vc, chunk.mask)[0].transpose(0, 1)  # (n, heads, d)

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """q (1, heads, n, d) over k, v (1, kv_heads, keys, d): SDPA (causal where `mask` is None),
        or with a soft-cap float32 matmuls in transformers' eager order (cap, mask, softmax)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                  enable_gqa=True)
        heads, n, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        qg = q[0].reshape(num_kv_heads, heads // num_kv_heads * n, head_dim).float()  # (kv_heads, group * n, d)
        scores = self._capped(torch.matmul(qg, k[0].float().transpose(-1, -2)) * self.scale)
        scores = scores.view(num_kv_heads, heads // num_kv_heads, n, -1)
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).view(num_kv_heads, -1, scores.shape[-1]), v[0].float())
        return out.view(1, heads, n, head_dim).to(q.dtype)
