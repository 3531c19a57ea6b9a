"""CUDA attention that reads the paged cache where it lies: Triton kernels over the step's ragged
batch (prefill chunks and decodes) that walk each sequence's block table, so no step copies a
context out of the cache (the flash backend gathers every context, every layer, every step).

A program takes one tile of a sequence's queries (BLOCK_Q tokens) for one KV head, with that
head's query heads packed into the tile's rows (GQA: the keys and values are read once for the
group), and runs an online softmax over the key tiles up to its last query's position: causal
within a chunk, every cached token before it. Scores and softmax in float32, as FlashAttention
(a float32 model's products in full float32, not TF32). Prefill chunks run that kernel.

Decodes (one query each) are split along their context instead (flash-decoding): a lone stream's
decode would otherwise be one program per KV head walking the whole context, a few of the GPU's
multiprocessors busy and the layer's attention ~15 us. A decode's keys are cut into partitions of
a fixed size, each partition's softmax is computed by one program, and a second kernel merges the
partitions in order. A sequence's result depends only on its own partitions, not on how many
programs share them, so a CUDA graph padded to its bucket and an eager step give the same values.
Decode metadata lives in fixed-size tensors, so decode-only steps can be captured in CUDA graphs
(engine/runner/cuda_graphs.py).
Triton compiles a kernel for each value class of its integer arguments (1, a multiple of 16,
other); the ones that change from step to step (the block tables' width, a decode's partitions
and programs) are not specialized, so each kernel compiles once per model, in the step the
runner makes at start-up, and never while requests wait on it.
A sliding-window group's programs start at the first key their window reads (a decode's
partitions cover only its window) and mask the keys before it; a soft-capped model's scores are
capped (softcap * tanh(scores / softcap)) before the mask, as transformers does.
Cache layout: BlockMajorCache, as the flash backend's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.base import AttentionBackend, AttentionParams, BlockMajorCache
from engine.batch import GroupTables, ModelInputs, host_tensor, padded_rows

KEY_TILE = 32  # keys per inner step; a power of two of at least 16 (tl.dot), any block size
PREFILL_QUERIES = 16  # query tokens per prefill tile (times the group: the tile's rows)
MAX_PARTITIONS = 64  # a decode's context is cut into at most this many partitions


@triton.jit
def _attend_key_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, key, key_ok, visible, kv_head, dims, dim_ok, scale,
                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                     SOFTCAP: tl.constexpr):
    """One tile of keys into the running softmax of the rows' queries `q`: reads the keys where
    `key_ok` from their blocks, scores those each row sees (`visible`, rows x keys), soft-capped
    where SOFTCAP > 0, and returns the rows' output so far, max and sum (float32). A row that has
    seen no key yet (padding) keeps its max at -inf and adds nothing."""
    block = tl.load(table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = block * stride_cb + (key % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(k_ptr + slot[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * scale  # (rows, keys) in float32
    if SOFTCAP > 0:  # softcap * tanh(s / softcap), tanh as 1 - 2 / (e^2x + 1): exact at both ends
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _paged_attention(out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                     tile_seq_ptr, tile_start_ptr, scale, window,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                     SOFTCAP: tl.constexpr):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first_query = tl.load(tile_start_ptr + tile)  # this tile's first query, counted within its sequence
    query_start = tl.load(query_start_ptr + seq)
    num_queries = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - num_queries  # position of the sequence's first query

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query < num_queries)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (query_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    position = cached + query
    key_end = cached + tl.minimum(first_query + BLOCK_Q, num_queries)  # keys the tile's last query sees

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    # the first key the tile's first query reads: its window's (window 0: the context's first)
    key_start = tl.where(window > 0, tl.maximum(cached + first_query - window + 1, 0), 0)
    for start in range(key_start, key_end, BLOCK_N):
        key = start + keys
        key_ok = key < key_end
        visible = key_ok[None, :] & (key[None, :] <= position[:, None])  # causal within the chunk
        visible = visible & ((window <= 0) | (key[None, :] > position[:, None] - window))
        acc, m_i, l_i = _attend_key_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, key, key_ok, visible, kv_head, dims,
                                         dim_ok, scale, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, PRECISION,
                                         SOFTCAP)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (query_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _first_key(seq_len, window):
    """A decode's first key: its window's (window 0: the context's first)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit(do_not_specialize=["stride_bt", "parts", "programs", "window"])
def _decode_partitions(acc_ptr, ml_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, scale, window,
                       stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, num_heads, parts, programs,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr,
                       PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Decode `seq` (its one query is token `seq`), KV head `kv_head`: every `programs`-th
    partition of the keys it reads (its context, or its window of it) from `first`, each one's
    unnormalized output, running max and sum (float32) stored at [seq, head, partition]."""
    seq, kv_head, first = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    key_start = _first_key(seq_len, window)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    keys = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for part in range(first, tl.cdiv(seq_len - key_start, PARTITION), programs):
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.minimum(key_start + part * PARTITION + PARTITION, seq_len)
        for start in range(key_start + part * PARTITION, end, BLOCK_N):  # every tile holds a key: maxima stay finite
            key = start + keys
            key_ok = key < end
            acc, m_i, l_i = _attend_key_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, key, key_ok, key_ok[None, :],
                                             kv_head, dims, dim_ok, scale, stride_cb, stride_cs, stride_ch,
                                             BLOCK_SIZE, PRECISION, SOFTCAP)
        index = (seq * num_heads + head) * parts + part
        tl.store(acc_ptr + index[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(ml_ptr + index * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + index * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["parts", "window"])
def _merge_partitions(out_ptr, acc_ptr, ml_ptr, seq_lens_ptr, window, stride_ot, stride_oh, num_heads, parts,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr):
    """One decode's query head: its partitions' softmaxes merged in partition order."""
    seq, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    ok = dims < HEAD_DIM
    base = (seq * num_heads + head) * parts
    same = dims * 0  # the partition's max and sum, read into every lane
    m_all = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_D], tl.float32)
    acc_all = tl.zeros([BLOCK_D], tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    for part in range(0, tl.cdiv(seq_len - _first_key(seq_len, window), PARTITION)):
        m = tl.load(ml_ptr + (base + part) * 2 + same)
        total = tl.load(ml_ptr + (base + part) * 2 + 1 + same)
        acc = tl.load(acc_ptr + (base + part) * HEAD_DIM + dims, mask=ok, other=0.0)
        m_new = tl.maximum(m_all, m)
        alpha = tl.exp(m_all - m_new)
        beta = tl.exp(m - m_new)
        acc_all = acc_all * alpha + acc * beta
        l_all = l_all * alpha + total * beta
        m_all = m_new
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, (acc_all / l_all).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _rope_and_write(qkv_ptr, cos_ptr, sin_ptr, qk_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_qkv, stride_cos, stride_qk, stride_slot,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """One head of one token: a query head is rotated into qk; a key head is rotated into qk and
    its slot; a value head is copied to its slot. Rounds as the layer's torch ops do: x * cos in
    the model's dtype, then + roll(x) * sin in float32, rounded once."""
    token, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    ok = dims < HEAD_DIM
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x = tl.load(row + dims, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
    cache_offset = (slot * NUM_KV_HEADS + head - NUM_HEADS) * HEAD_DIM
    if head < NUM_HEADS + NUM_KV_HEADS:
        rolled = tl.load(row + (dims + HEAD_DIM // 2) % HEAD_DIM, mask=ok, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + token * stride_cos + dims, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_cos + dims, mask=ok, other=0.0).to(tl.float32)
        scaled = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        out = (scaled + rolled * sin).to(x.dtype)
        tl.store(qk_ptr + token * stride_qk + head * HEAD_DIM + dims, out, mask=ok)
        if head >= NUM_HEADS:
            tl.store(k_cache_ptr + cache_offset + dims, out.to(k_cache_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(v_cache_ptr + cache_offset - NUM_KV_HEADS * HEAD_DIM + dims, x.to(v_cache_ptr.dtype.element_ty),
                 mask=ok)


@dataclass(slots=True)
class Launch:
    """One prefill launch's tiles: tile_seq[i] is the sequence of tile i, tile_start[i] its first query."""
    tile_seq: torch.Tensor  # (tiles,) int32
    tile_start: torch.Tensor  # (tiles,) int32
    block_q: int  # query tokens per tile


@dataclass(slots=True)
class DecodeSplit:
    """The step's decodes: its first `rows` sequences, one query each. `programs` programs per
    (decode, KV head) share its partitions (a launch's choice: no value depends on it); `parts`
    (at least the longest context's partitions) sizes the partial results."""
    rows: int
    programs: int
    parts: int


@dataclass(slots=True)
class PagedMetadata:
    slot_mapping: torch.Tensor  # (T,) where the step's new keys go
    window: int  # the KV group's sliding window, 0: full attention
    block_tables: torch.Tensor  # (B, width) int32, each sequence's blocks (rows past its length unread)
    seq_lens: torch.Tensor  # (B,) int32 context length after this step
    query_start: torch.Tensor | None  # (B + 1,) int32 token offsets, for the prefill launches (None without)
    decodes: DecodeSplit | None
    launches: list[Launch]  # the prefill chunks'


def partition_size(max_model_len: int) -> int:
    """Keys per decode partition: 64, or more where the longest context would need more than
    MAX_PARTITIONS (the partial results a CUDA graph holds grow with them)."""
    return max(2 * KEY_TILE, _pow2(-(-max_model_len // MAX_PARTITIONS)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class TritonPagedBackend(BlockMajorCache, AttentionBackend):
    name = "triton"
    captures_decodes = True

    def __init__(self, params: AttentionParams, max_model_len: int):
        super().__init__(params)
        self.partition = partition_size(max_model_len)
        self.max_parts = -(-max_model_len // self.partition)

    def group_metadata(self, inputs: ModelInputs, group: GroupTables) -> PagedMetadata:
        device = inputs.input_ids.device

        def int32(values) -> torch.Tensor:
            return host_tensor(values, torch.int32).to(device)

        tables = padded_rows(group.block_tables, 0, torch.int32).to(device)
        num_decodes, launches, decodes, query_start = inputs.num_decodes, [], None, None
        if num_decodes:
            longest = max(inputs.seq_lens[:num_decodes])
            if group.window is not None:
                longest = min(longest, group.window)
            decodes = self._split(num_decodes, -(-longest // self.partition), device)
        if num_decodes < len(inputs.seq_lens):
            tiles = [(b, first) for b in range(num_decodes, len(inputs.seq_lens))
                     for first in range(0, inputs.query_start_loc[b + 1] - inputs.query_start_loc[b], PREFILL_QUERIES)]
            launches.append(Launch(int32([b for b, _ in tiles]), int32([f for _, f in tiles]), PREFILL_QUERIES))
            query_start = int32(inputs.query_start_loc)
        return PagedMetadata(group.slot_mapping, group.window or 0, tables, int32(inputs.seq_lens), query_start,
                             decodes, launches)

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        window: int | None) -> PagedMetadata:
        """One KV group's metadata of a decode-only step over fixed buffers (a CUDA graph's
        inputs): every sequence one query, room for the longest context's partitions."""
        split = self._split(seq_lens.numel(), self.max_parts, seq_lens.device)
        return PagedMetadata(slot_mapping, window or 0, block_tables, seq_lens, None, split, [])

    @staticmethod
    def _split(rows: int, parts: int, device: torch.device) -> DecodeSplit:
        """Programs per decode: enough that the decodes fill the multiprocessors (a lone stream's
        partitions each get one), one where the batch already does."""
        return DecodeSplit(rows, max(1, min(parts, -(-_multiprocessors(device) // rows))), parts)

    def rope_and_write(self, qkv, cos, sin, layer_cache, metadata: PagedMetadata, num_heads, qk_norms=None):
        """RoPE of q and k and the write of k and v to their slots in one kernel, instead of five
        ops a layer (a decode step's time is its kernel count); q/k norms are the layer's."""
        if qk_norms is not None:
            return None
        _, _, _, num_kv_heads, head_dim = layer_cache.shape
        num_tokens = qkv.shape[0]
        qk = torch.empty(num_tokens, num_heads + num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _rope_and_write[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, qk, layer_cache[0], layer_cache[1], metadata.slot_mapping,
            qkv.stride(0), cos.stride(0), qk.stride(0), metadata.slot_mapping.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim))
        return qk

    def forward(self, q, k, v, layer_cache, metadata: PagedMetadata, kv_written: bool = False):
        if not kv_written:
            self.write_kv(layer_cache, metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        group = q.shape[1] // layer_cache.shape[-2]
        if metadata.decodes is not None:
            self._decode(out, q, layer_cache, metadata, metadata.decodes, group)
        for launch in metadata.launches:
            self._launch(out, q, layer_cache, metadata, launch, group)
        return out.reshape(q.shape[0], -1)

    def _decode(self, out, q, layer_cache, metadata: PagedMetadata, split: DecodeSplit, group: int) -> None:
        _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        num_heads = q.shape[1]
        acc = torch.empty(split.rows, num_heads, split.parts, head_dim, dtype=torch.float32, device=q.device)
        max_and_sum = torch.empty(split.rows, num_heads, split.parts, 2, dtype=torch.float32, device=q.device)
        block_d = max(16, _pow2(head_dim))
        _decode_partitions[(split.rows, num_kv_heads, split.programs)](
            acc, max_and_sum, q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, self.scale,
            metadata.window,
            q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            metadata.block_tables.stride(0), num_heads, split.parts, split.programs,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=max(16, _pow2(group)),
            BLOCK_N=max(KEY_TILE, _pow2(block_size)), BLOCK_SIZE=block_size, PARTITION=self.partition,
            PRECISION=_precision(q.dtype), SOFTCAP=self.softcap or 0.0)
        _merge_partitions[(split.rows, num_heads)](
            out, acc, max_and_sum, metadata.seq_lens, metadata.window, out.stride(0), out.stride(1), num_heads,
            split.parts,
            HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION=self.partition)

    def _launch(self, out, q, layer_cache, metadata: PagedMetadata, launch: Launch, group: int) -> None:
        _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        _paged_attention[(launch.tile_seq.numel(), num_kv_heads)](
            out, q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start,
            launch.tile_seq, launch.tile_start, self.scale, metadata.window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), metadata.block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)), BLOCK_Q=launch.block_q,
            BLOCK_M=max(16, _pow2(launch.block_q * group)), BLOCK_N=max(KEY_TILE, _pow2(block_size)),
            BLOCK_SIZE=block_size, PRECISION=_precision(q.dtype), SOFTCAP=self.softcap or 0.0)


def _precision(dtype: torch.dtype) -> str:
    """A float32 model's products in full float32, not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"
