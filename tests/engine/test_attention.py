"""Attention backends agree with a dense reference on a mixed ragged batch (decodes of different
context lengths + prefill chunks with and without cached context), with GQA, and on decodes whose
contexts span several of the CPU kernel's chunks."""
from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionParams
from engine.attention.selector import select_backend
from engine.cpu_kernels import load_cpu_kernels
from engine.models.decoder import _rope
from engine.runner.inputs import build_inputs
from engine.scheduler.output import ScheduledRequest
from tests.engine.helpers import ragged_batch

KV_HEADS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 6, 16, 4, 160
MIXED = [(13, 1), (2, 1), (30, 1), (7, 1), (0, 9), (10, 6)]  # (start_pos, num_new): 4 decodes, 2 prefills
LONG_DECODES = [(199, 1), (63, 1), (64, 1), (127, 1), (0, 3)]  # contexts of 1-3 chunks of 64 tokens


def _batch(seed: int, shapes: list[tuple[int, int]]):
    return ragged_batch(seed, shapes, NUM_BLOCKS, BLOCK)


def _reference(q, keys, values, start, n):
    """Dense causal attention of n queries at positions start.. over keys[:start + n]."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1)  # (L, heads, d)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
    mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(n))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shapes", [MIXED, LONG_DECODES], ids=["mixed", "long_decodes"])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_backend_matches_dense_reference(backend_name, shapes, kv_cache_dtype):
    """With an fp16 cache, every query (a decode, a chunk reading cached context, a prompt's first
    chunk attending to its own keys) sees the keys and values as the cache rounds them."""
    torch.manual_seed(0)
    scheduled = _batch(1, shapes)
    backend = select_backend(backend_name, torch.device("cpu"), torch.float32, AttentionParams(HEAD_DIM ** -0.5))
    cache = backend.allocate_kv_cache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, kv_cache_dtype, torch.device("cpu"))
    history = {}
    for item in scheduled:  # fill each request's cached context through the backend's own layout
        keys, values = torch.randn(item.start_pos + len(item.token_ids), KV_HEADS, HEAD_DIM), None
        values = torch.randn_like(keys)
        history[item.request.request_id] = (keys, values)
        if item.start_pos:
            ctx = [ScheduledRequest(item.request, item.request.token_ids[:item.start_pos], 0, item.block_tables, False)]
            inputs = build_inputs(ctx, BLOCK, torch.device("cpu"), (None,))
            q = torch.randn(item.start_pos, HEADS, HEAD_DIM)
            backend.forward(q, keys[:item.start_pos], values[:item.start_pos], cache[0],
                            backend.build_metadata(inputs)[0])
    inputs = build_inputs(scheduled, BLOCK, torch.device("cpu"), (None,))
    ordered = sorted(scheduled, key=lambda s: (len(s.token_ids) > 1, s.start_pos if len(s.token_ids) == 1 else 0))
    q = torch.randn(inputs.input_ids.shape[0], HEADS, HEAD_DIM)
    k = torch.cat([history[s.request.request_id][0][s.start_pos:] for s in ordered])
    v = torch.cat([history[s.request.request_id][1][s.start_pos:] for s in ordered])
    out = backend.forward(q, k, v, cache[0], backend.build_metadata(inputs)[0]).view(-1, HEADS, HEAD_DIM)
    for b, item in enumerate(ordered):
        t0, t1 = inputs.query_start_loc[b], inputs.query_start_loc[b + 1]
        keys, values = (x.to(kv_cache_dtype).float() for x in history[item.request.request_id])
        expected = _reference(q[t0:t1], keys, values, item.start_pos, t1 - t0)
        torch.testing.assert_close(out[t0:t1], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (15, 3)])  # query heads per kv head: 1, 3, 5
def test_the_kernel_matches_the_reference_at_model_head_sizes(heads, kv_heads, head_dim, kv_cache_dtype):
    """Head sizes of real models (SmolLM2 64, Llama 128, and 80, which is no multiple of four
    vectors) and groups of 1, 3 and 5 query heads per kv head (five: a pass of four, then one),
    over contexts that end inside a kernel chunk, on one, and past several."""
    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(4)
    block, num_blocks = 16, 112
    lens = torch.tensor([1, 15, 16, 17, 64, 100, 250])
    tables = torch.randperm(num_blocks, generator=gen).view(7, 16)
    cache = torch.randn(2, kv_heads, num_blocks, block, head_dim, generator=gen).to(kv_cache_dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    out = kernels.paged_decode_attention(q, cache, tables, lens, head_dim ** -0.5, 0, 0.0)
    group = heads // kv_heads
    for b, n in enumerate(lens.tolist()):
        kv = cache[:, :, tables[b]].flatten(2, 3)[:, :, :n].float().repeat_interleave(group, dim=1)  # (2, heads, n, d)
        weights = (torch.einsum("hd,hkd->hk", q[b], kv[0]) * head_dim ** -0.5).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hk,hkd->hd", weights, kv[1]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
def test_the_fused_rope_and_kv_write_computes_the_layers_torch_ops_bit_for_bit(kv_cache_dtype):
    """engine/csrc/rope_kv.cpp against decoder.py's _rope and the torch backend's own write (stack,
    transpose, convert, index_copy_), SmolLM2's heads: the same q, k and cache bits."""
    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:tokens]
    caches = [torch.zeros(2, kv_heads, NUM_BLOCKS, BLOCK, head_dim, dtype=kv_cache_dtype) for _ in range(2)]
    fused = kernels.rope_write_kv(qkv, cos, sin, caches[0], slots, heads, True, None, None, 0.0)
    qk = _rope(qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim), cos[:, None],
               sin[:, None])
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    flat = caches[1].view(2, kv_heads, -1, head_dim)
    flat.index_copy_(2, slots, torch.stack((qk[:, heads:], v)).transpose(1, 2).to(kv_cache_dtype))
    assert torch.equal(fused, qk) and torch.equal(caches[0], caches[1])
    q = kernels.rope_write_kv(qkv, cos, sin, caches[0], slots, heads, False, None, None, 0.0)
    assert torch.equal(q, qk[:, :heads])


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
def test_a_decode_attends_alike_alone_and_in_any_batch(kv_cache_dtype):
    """The CPU kernel splits each request's context by its own length, never by the batch: a
    request's output is the same bits alone and among others of every length."""
    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM, generator=gen).to(kv_cache_dtype)
    lens = torch.tensor([128, 1, 64, 65, 33])
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:5 * 32].view(5, 32)
    q = torch.randn(5, HEADS, HEAD_DIM, generator=gen)
    together = kernels.paged_decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5, 0, 0.0)
    for b in range(5):
        alone = kernels.paged_decode_attention(q[b:b + 1], cache, tables[b:b + 1], lens[b:b + 1], HEAD_DIM ** -0.5,
                                               0, 0.0)
        assert torch.equal(alone[0], together[b])


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cpu_kv_pool_is_zeros_that_take_memory_only_as_blocks_are_written(kv_cache_dtype):
    """A 256 MiB pool adds no resident memory until written (torch.zeros writes all of it at
    start-up), reads as zeros, starts on a page, and a first write faults in plain pages, not huge
    ones (whose first touch may wait on the kernel's compaction)."""
    import psutil

    backend = select_backend("cpu", torch.device("cpu"), torch.float32, AttentionParams(HEAD_DIM ** -0.5))
    num_blocks = 2 ** 28 // (2 * BLOCK * KV_HEADS * HEAD_DIM * kv_cache_dtype.itemsize)
    process = psutil.Process()
    before = process.memory_info().rss
    cache = backend.allocate_kv_cache(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, kv_cache_dtype, torch.device("cpu"))
    assert process.memory_info().rss - before < 2 ** 24
    assert cache.dtype == kv_cache_dtype and cache.is_contiguous() and cache.data_ptr() % 4096 == 0
    cache[0, 0, 0, 0] = 1  # a block's rows
    before = process.memory_info().rss
    cache[0, 0, 0, -1] = 1  # another's: one plain page (a huge page would add 2 MiB)
    assert process.memory_info().rss - before < 2 ** 20
    assert cache.nbytes == 2 ** 28 and cache.count_nonzero() == 2 * cache[0, 0, 0, 0].numel()


def test_start_up_loads_the_kernel_from_its_cache_and_never_compiles(monkeypatch):
    """`make install` built the kernel (or the first load does); later loads, as every engine
    start-up does, import the cached library: compiling there fails this test."""
    from engine import cpu_kernels

    cpu_kernels.load_cpu_kernels.cache_clear()
    assert cpu_kernels.load_cpu_kernels() is not None

    def no_build(*args):
        raise AssertionError("start-up compiled the kernel")

    monkeypatch.setattr(cpu_kernels, "_build", no_build)
    cpu_kernels.load_cpu_kernels.cache_clear()
    try:
        assert cpu_kernels.load_cpu_kernels() is not None
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()
