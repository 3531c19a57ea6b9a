"""Sliding-window attention as an engine feature: layers grouped by window (engine/kv_cache/layout.py),
a sliding group's blocks dropped as requests pass them and every block free at the end, prefix
hits that need only the window's blocks, every CPU attention backend reading only a layer's window
(and soft-capping scores), and a Gemma-3-shaped model holding a fraction of full attention's blocks."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.base import AttentionParams
from engine.attention.selector import select_backend
from engine.kv_cache.layout import NULL_BLOCK, KVLayout
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from tests.conftest import save_tiny_model
from tests.engine.helpers import attention_case, expected_attention, make_request, run_attention

GEMMA3_PATTERN = ([24] * 5 + [None]) * 5  # a Gemma-3-shaped stack of 30 layers: five local to one global


def test_layers_that_attend_alike_share_a_group_and_groups_are_equal_in_size():
    layout = KVLayout.for_windows(GEMMA3_PATTERN, 8192)
    assert layout.num_slots == 5 and layout.num_groups == 6
    assert layout.windows == (24, 24, 24, 24, 24, None)
    assert layout.groups[-1].layers == (5, 11, 17, 23, 29)
    assert [layout.group_of[i] for i in range(6)] == [0, 0, 0, 0, 0, 5]
    assert [layout.slot_of[i] for i in (0, 4, 6, 5, 11)] == [0, 4, 0, 0, 1]
    uneven = KVLayout.for_windows([None] * 4 + [16] * 22, 8192)  # gemma-3-1b: 4 global, 22 local layers
    assert uneven.num_slots == 4 and [len(g.layers) for g in uneven.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert KVLayout.for_windows([4096, None], 2048).is_uniform  # a window past every context is full attention
    assert KVLayout.for_windows([None] * 3, 100).groups[0].layers == (0, 1, 2)


def _advance(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    kv.cache_full_blocks(request)
    kv.check_integrity()


def test_a_sliding_group_frees_the_blocks_its_window_has_passed_and_everything_at_the_end():
    """1. A full and a sliding group (window 8, blocks of 4), a request computed 4 tokens a step.
    2. The full group holds every block; the sliding group only those the next query reads, the
    rest NULL and back in the pool. 3. Freed, every block is free again."""
    layout = KVLayout.for_windows([None, 8], 1000)
    kv = KVCacheManager(32, 4, layout=layout)
    request = make_request(40)
    for _ in range(10):
        _advance(kv, request, 4)
    full, sliding = kv.block_tables[request.request_id]
    assert len(full) == 10 and NULL_BLOCK not in full
    assert kv.allocate_slots(request, 1) is not None  # the next query at 40 reads keys 33..40: blocks 8-10
    assert sliding[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in sliding[8:]
    assert kv.num_held_blocks(request) == 11 + 3 and kv.num_free_blocks == 32 - 14
    kv.check_integrity()
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 32


def test_a_prefix_hit_needs_only_the_blocks_a_sliding_window_reads():
    """1. Request A computes 32 tokens: its sliding group drops its early blocks (cached, free).
    2. B, with A's 32 tokens and more, finds all 8 blocks: the full group's every one, the sliding
    group's last two (its first query reads keys 25..32), the rest NULL. 3. Once the sliding
    group's block 7 is evicted, B's longest hit is 7 blocks, whose next query's window does not read it."""
    layout = KVLayout.for_windows([None, 8], 1000)
    kv = KVCacheManager(24, 4, layout=layout)
    prompt = list(range(1, 33))
    a = Request("a", prompt, SamplingParams(max_tokens=4))
    for _ in range(8):
        _advance(kv, a, 4)
    kv.free(a)
    b = Request("b", prompt + [99, 98, 97], SamplingParams(max_tokens=4))
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 32
    assert NULL_BLOCK not in hit.block_ids[0] and hit.block_ids[1][:6] == (NULL_BLOCK,) * 6
    assert kv.allocate_slots(b, 3, hit) is not None
    b.num_computed_tokens = 32
    kv.check_integrity()
    kv.free(b)
    _evict(kv.pool, hit.block_ids[1][7])
    kv.check_integrity()
    assert kv.get_computed_blocks(b).num_tokens == 28  # 7 blocks: the window of position 28 reads 21..28


def _evict(pool, block_id: int) -> None:
    """What handing a free cached block out does to it (BlockPool.get_new_blocks), then freed again."""
    pool.touch([block_id])
    del pool.cached_blocks[pool.block_hash[block_id]]
    pool.block_hash[block_id] = None
    pool.free_blocks([block_id])


def test_a_gemma3_shaped_model_holds_a_fraction_of_full_attentions_blocks(tmp_path):
    """A tiny Gemma-3-shaped model (two local layers with a window of 24 to one global) decoding a
    260-token sequence: its KV cache holds full attention's blocks for the global group only, and
    for the local groups never more than their window and a step's tokens."""
    model = save_tiny_model(tmp_path / "g3", "gemma3")
    llm = LLM(model, quantization="none", block_size=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    kv, engine = llm.engine.kv, llm.engine
    assert kv.layout.windows == (24, 24, None)
    engine.add_request("r", list(range(3, 63)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    peaks = [0, 0, 0]
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("r")
        if request is not None and "r" in kv.block_tables:
            for g, table in enumerate(kv.block_tables["r"]):
                peaks[g] = max(peaks[g], sum(b != NULL_BLOCK for b in table))
    assert peaks[2] == 260 // 4  # the global group: every block
    assert max(peaks[:2]) <= -(-(24 - 1 + 32) // 4) + 1  # the local groups: a window and a chunk
    assert kv.num_free_blocks == kv.num_blocks
    full_attention = 6 * (260 // 4)  # blocks of one layer each: every layer holding the whole context
    assert (2 * peaks[2] + 2 * (peaks[0] + peaks[1])) / full_attention < 0.5


WINDOWED = [(13, 1), (2, 1), (300, 1), (77, 1), (0, 90), (40, 70), (200, 17), (30, 1)]  # (cached, new tokens)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 24, 70])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_cpu_attention_reads_only_the_window_and_caps_scores(backend_name, window, softcap):
    """Decodes and chunks, with cached context or none, against float32 attention within the
    window: the blocks before a request's window hold NaNs, so a backend that read them would
    fail; a soft-cap is applied before the mask, as transformers does."""
    case = attention_case(3, WINDOWED, 16, 6, 2, 64, torch.device("cpu"), window=window)
    backend = select_backend(backend_name, torch.device("cpu"), torch.float32, AttentionParams(case.scale, softcap))
    out = run_attention(backend, case, torch.float32, torch.device("cpu"))
    assert not out.isnan().any()
    for rows, expected in expected_attention(case, torch.float32, softcap):
        torch.testing.assert_close(out[rows], expected, rtol=1e-4, atol=1e-5)
