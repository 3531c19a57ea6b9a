"""Prefix caching through the scheduler: exact reused blocks and computed tokens, hit counters,
lazy LRU eviction, and greedy outputs equal with caching on and off on the tiny model."""
from __future__ import annotations

import os

import pytest

from engine import LLMEngine, SamplingParams
from engine.tokenization import encode_chat
from tests.engine.helpers import make_request, make_scheduler, sampled, step

BS = 4


def _run(sched, request):
    """Adds a request and steps until it finished; returns its first step's output."""
    sched.add_request(request)
    first = step(sched)
    while request.request_id in sched.requests:
        step(sched)
    return first


def _step_add(sched, request):
    sched.add_request(request)
    return step(sched)


PREFIX = list(range(101, 111))  # 10 tokens: 2 full blocks of 4, and 2 tokens of a third


def test_second_request_reuses_the_full_cached_blocks_of_a_shared_prefix():
    """1. A (prefix + 3 tokens = 13) computes all 13 tokens; its 3 full blocks get cached.
    2. B (prefix + 4 other tokens = 14) shares 2 full blocks (8 tokens) with A: block 3 differs.
       B's first step schedules 14 - 2 * 4 = 6 tokens, into A's blocks 0 and 1 plus new ones."""
    sched = make_scheduler(num_blocks=16, block_size=BS)
    a = make_request(prompt=PREFIX + [201, 202, 203], max_tokens=5)  # still running in step 2
    out = _step_add(sched, a)
    assert out.num_scheduled_tokens == {a.request_id: 13}
    a_blocks = list(sched.kv.block_tables[a.request_id][0])
    b = make_request(prompt=PREFIX + [301, 302, 303, 304], max_tokens=2)
    out = _step_add(sched, b)
    assert out.num_scheduled_tokens[b.request_id] == 14 - 2 * BS
    sched_b = next(s for s in out.scheduled if s.request is b)
    assert sched_b.start_pos == 8 and sched_b.token_ids == [109, 110, 301, 302, 303, 304]
    assert sched_b.block_tables[0][:2] == a_blocks[:2] and sched_b.block_tables[0][2] not in a_blocks
    assert [sched.kv.pool.ref_cnt[x] for x in a_blocks[:3]] == [2, 2, 1]
    assert b.num_cached_prompt_tokens == 8
    c = sched.counters
    assert (c.num_prefix_query_tokens, c.num_prefix_hit_tokens) == (13 + 14, 8)
    assert c.num_prompt_tokens == 13 + 6  # cache hits are not computed prompt tokens


def test_identical_prompt_recomputes_only_its_last_block():
    """A 12-token prompt is 3 full blocks; its twin reuses 2 and computes the last 4 tokens (the
    last token's logits are needed, so a full hit is cut back by one block)."""
    sched = make_scheduler(num_blocks=16, block_size=BS)
    prompt = list(range(101, 113))
    _run(sched, make_request(prompt=prompt, max_tokens=1))
    twin = make_request(prompt=list(prompt), max_tokens=1)
    assert _run(sched, twin).num_scheduled_tokens == {twin.request_id: 12 - 2 * BS}
    assert (sched.counters.num_prefix_query_tokens, sched.counters.num_prefix_hit_tokens) == (24, 8)


def test_cached_blocks_include_generated_tokens():
    """Multi-turn: turn 2's prompt is turn 1's prompt + its outputs + new tokens. Turn 1 computed
    8 prompt + 4 outputs (the 5th output is sampled, never fed): 3 full blocks are reused."""
    sched = make_scheduler(num_blocks=16, block_size=BS)
    turn1 = make_request(prompt=list(range(101, 109)), max_tokens=5)
    _run(sched, turn1)
    assert turn1.output_token_ids == [5] * 5
    turn2 = make_request(prompt=turn1.token_ids + [401, 402, 403], max_tokens=1)
    assert _run(sched, turn2).num_scheduled_tokens == {turn2.request_id: 16 - 3 * BS}


def test_prefix_caching_off_computes_everything_and_counts_no_hits():
    sched = make_scheduler(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    _run(sched, make_request(prompt=PREFIX + [201, 202, 203], max_tokens=1))
    b = make_request(prompt=PREFIX + [301, 302, 303, 304], max_tokens=1)
    assert _run(sched, b).num_scheduled_tokens == {b.request_id: 14}
    assert sched.counters.num_prefix_hit_tokens == 0 and sched.counters.num_prefix_query_tokens == 27
    assert sched.kv.pool.cached_blocks == {}


def test_hit_rate_moves_with_shared_prefixes():
    """Hit rate = hit tokens / looked-up tokens, cumulative: 0 after a cold request, then 8/(13+14)."""
    sched = make_scheduler(num_blocks=16, block_size=BS)
    rate = lambda c: c.num_prefix_hit_tokens / c.num_prefix_query_tokens  # noqa: E731
    _run(sched, make_request(prompt=PREFIX + [201, 202, 203], max_tokens=1))
    assert rate(sched.counters) == 0.0
    _run(sched, make_request(prompt=PREFIX + [301, 302, 303, 304], max_tokens=1))
    assert rate(sched.counters) == pytest.approx(8 / 27)


def test_unreferenced_cached_blocks_are_evicted_lazily_in_lru_order():
    """8 blocks of 4.
    1. A (12 tokens, max_tokens 1) finishes: its 3 cached blocks 0, 1, 2 are free but keep their
       hashes, at the tail of the free queue (freed tail first: 2, 1, 0).
    2. B (16 tokens) takes 4 uncached free blocks 3-6: nothing is evicted.
    3. Next step B's decode takes the last uncached block 7 and C (4 tokens) needs one more: the
       LRU cached block 2 (A's last block) is evicted, exactly one eviction; 0 and 1 keep A's prefix.
    4. A again with 4 more tokens: 2 blocks hit (8 tokens), not 3."""
    sched = make_scheduler(num_blocks=8, block_size=BS)
    pool = sched.kv.pool
    a_prompt = list(range(101, 113))
    _run(sched, make_request(prompt=a_prompt, max_tokens=1))
    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert len(pool.cached_blocks) == 3 and pool.num_evictions == 0

    b = make_request(prompt=list(range(501, 517)), max_tokens=3)
    _step_add(sched, b)
    assert sched.kv.block_tables[b.request_id][0] == [3, 4, 5, 6] and pool.num_evictions == 0
    assert all(pool.block_hash[i] is not None for i in (0, 1, 2))

    c = make_request(prompt=list(range(601, 605)), max_tokens=1)
    sched.add_request(c)
    out = sched.schedule()
    assert sched.kv.block_tables[b.request_id][0] == [3, 4, 5, 6, 7] and sched.kv.block_tables[c.request_id][0] == [2]
    assert pool.num_evictions == 1 and pool.block_hash[2] is None
    assert pool.block_hash[0] is not None and pool.block_hash[1] is not None
    assert list(pool.free_queue) == [1, 0]
    sched.update_from_output(out, sampled(out))
    while sched.has_unfinished():
        step(sched)

    again = make_request(prompt=a_prompt + [1, 2, 3, 4], max_tokens=1)
    out = _step_add(sched, again)
    assert again.num_cached_prompt_tokens == 2 * BS
    assert out.num_scheduled_tokens == {again.request_id: 16 - 2 * BS}


def test_no_eviction_while_uncached_free_blocks_remain():
    """Blocks without a hash are handed out first: cached blocks survive until the pool runs dry."""
    sched = make_scheduler(num_blocks=12, block_size=BS)
    for i in range(3):  # 3 sequential requests of 3 blocks each: 9 distinct cached blocks
        _run(sched, make_request(prompt=list(range(700 + 20 * i, 712 + 20 * i)), max_tokens=1))
    assert sched.kv.pool.num_evictions == 0
    assert len(sched.kv.pool.cached_blocks) == 9


def test_a_hit_refreshes_lru_order():
    """6 blocks of 4; 9-token prompts cache 2 full blocks and hold a third, uncached one.
    1. X then Y run and finish: free queue [4, 5, 1, 0, 3, 2] (X's cached 1, 0 older than Y's 3, 2).
    2. X's prompt again: hits blocks 0 and 1 and, when it finishes, returns them behind Y's.
    3. A 16-token request takes the uncached 4, 5, then evicts Y's blocks 3, 2, not X's."""
    sched = make_scheduler(num_blocks=6, block_size=BS)
    pool = sched.kv.pool
    x_prompt, y_prompt = list(range(101, 110)), list(range(201, 210))
    _run(sched, make_request(prompt=x_prompt, max_tokens=1))
    _run(sched, make_request(prompt=y_prompt, max_tokens=1))
    assert list(pool.free_queue) == [4, 5, 1, 0, 3, 2]
    x_again = make_request(prompt=list(x_prompt), max_tokens=1)
    _run(sched, x_again)
    assert x_again.num_cached_prompt_tokens == 8
    assert list(pool.free_queue) == [4, 5, 3, 2, 1, 0]
    z = make_request(prompt=list(range(401, 417)), max_tokens=2)
    _step_add(sched, z)
    assert sched.kv.block_tables[z.request_id][0] == [4, 5, 3, 2]
    assert pool.num_evictions == 2 and pool.block_hash[0] is not None and pool.block_hash[1] is not None


# ---- through the real tiny model -------------------------------------------------------------
SYSTEM = ("you sing songs about old ships sailing far away while the cat sat on a mat and dogs ran fast "
          "over green hills and blue lakes under bright stars")
FIRST = ["the cat sat on a mat", "dogs ran fast over green hills", "people sang songs about stars"]
SECOND = ["and the blue lakes", "while old ships sailed", "under bright stars far away"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """All prompts queued at once; per request, its output tokens and cached prompt tokens."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids if out.outputs else [])
            cached[out.request_id] = out.num_cached_tokens
    engine.kv.check_integrity()
    return [(tokens[str(i)], cached[str(i)]) for i in range(len(prompts))]


def _multi_turn_prompts(model_dir: str) -> list[list[int]]:
    """Three users, one shared system prompt; turn 2 extends turn 1 with its greedy reply."""
    engine = LLMEngine.from_engine_args(model_dir, enable_prefix_caching=False)
    turn1 = [encode_chat(engine.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
             for q in FIRST]
    replies = [tokens for tokens, _ in _generate(engine, turn1)]
    tok = engine.tokenizer
    turn2 = [t + r + tok.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)
             for t, r, q in zip(turn1, replies, SECOND)]
    return turn1 + turn2


def _expected_cached(prompts: list[list[int]], outputs: list[list[int]], block_size: int) -> list[int]:
    """Strictly sequential requests, nothing evicted: each reuses the full blocks of its longest
    common prefix with any earlier request's computed tokens (prompt + all outputs but the last),
    keeping at least one token to compute."""
    expected = []
    for k, prompt in enumerate(prompts):
        best = 0
        for j in range(k):
            computed = prompts[j] + outputs[j][:-1]
            lcp = len(os.path.commonprefix([prompt, computed]))
            best = max(best, min(lcp // block_size, (len(prompt) - 1) // block_size) * block_size)
        expected.append(best)
    return expected


@pytest.fixture(scope="module")
def multi_turn(tiny_llama) -> tuple[str, list[list[int]]]:
    return tiny_llama, _multi_turn_prompts(tiny_llama)


@pytest.mark.parametrize("engine_args", [dict(max_num_seqs=1), dict(max_num_seqs=4, max_num_batched_tokens=16)],
                         ids=["sequential", "batched-chunked"])
def test_greedy_outputs_equal_with_prefix_caching_on_and_off(multi_turn, engine_args):
    """Shared system prompt + multi-turn prompts: token-identical greedy outputs with the cache on
    and off; sequentially, every request's cached token count is exactly predicted."""
    tiny_llama, prompts = multi_turn
    common = dict(block_size=BS, num_blocks=512, **engine_args)
    off = _generate(LLMEngine.from_engine_args(tiny_llama, enable_prefix_caching=False, **common), prompts)
    on_engine = LLMEngine.from_engine_args(tiny_llama, enable_prefix_caching=True, **common)
    on = _generate(on_engine, prompts)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(c == 0 for _, c in off)
    stats = on_engine.get_stats()
    assert stats.prefix_cache_hit_rate > 0
    if engine_args["max_num_seqs"] == 1:
        expected = _expected_cached(prompts, [t for t, _ in on], BS)
        assert [c for _, c in on] == expected
        system = len(os.path.commonprefix(prompts[:len(FIRST)]))  # the shared system prompt
        assert system > 3 * BS and all(c >= system // BS * BS for c in expected[1:])
        assert stats.prefix_cache_hit_rate == pytest.approx(sum(expected) / sum(map(len, prompts)))
        assert stats.num_prompt_tokens == sum(map(len, prompts)) - sum(expected)
