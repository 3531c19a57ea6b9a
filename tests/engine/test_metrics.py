"""Engine statistics (EngineStats) and per-request timings (RequestMetrics) on known workloads:
model-free through Scheduler.make_stats, then through LLMEngine on the tiny model."""
from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.metrics import StepStats
from tests.engine.helpers import make_request, make_scheduler, sampled

BS = 4


def _prompt(first: int, n: int) -> list[int]:
    return [first + i for i in range(n)]  # distinct first tokens: no accidental prefix hits


class _Steps:
    """Steps a scheduler with fake tokens, counting steps as the engine does."""

    def __init__(self, sched):
        self.sched, self.last = sched, StepStats()

    def step(self, token: int = 5):
        out = self.sched.schedule()
        self.sched.update_from_output(out, sampled(out, token))
        self.last = self.last.after(len(out.scheduled), out.total_num_scheduled_tokens, 1.0, 0.0)
        self.sched.kv.check_integrity()
        return self.snapshot()

    def snapshot(self):
        return self.sched.make_stats(self.last)


def _queue_shape(s) -> tuple:
    return s.num_waiting, s.num_running, s.num_swapped, s.batch_size, s.batch_tokens


def test_stats_follow_a_known_workload_step_by_step():
    """64 blocks of 4, two sequence slots; prompts of 10, 6, 9 tokens with 3, 2, 2 outputs.
    1. r0 and r1 prefill (16 tokens, 3 + 2 blocks); r2 waits with its 9 tokens queued.
    2. Both decode; r1 has its 2 outputs and finishes.
    3. r0 decodes its last token and finishes; r2 prefills (1 + 9 tokens).
    4. r2 decodes and finishes: nothing left, no block owned."""
    sched = make_scheduler(num_blocks=64, block_size=BS, max_num_seqs=2)
    stats = _Steps(sched)
    reqs = [make_request(prompt=_prompt(100 * (i + 1), n), max_tokens=m, arrival_time=float(i))
            for i, (n, m) in enumerate([(10, 3), (6, 2), (9, 2)])]
    for r in reqs:
        sched.add_request(r)
    s = stats.snapshot()
    assert _queue_shape(s) == (3, 0, 0, 0, 0) and s.num_queued_tokens == 25 and s.kv_usage == 0.0

    s = stats.step()
    assert _queue_shape(s) == (1, 2, 0, 2, 16)
    assert s.num_queued_tokens == 9 and s.num_free_blocks == 64 - 5 and s.kv_usage == pytest.approx(5 / 64)
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_steps) == (16, 2, 1)

    s = stats.step()
    assert _queue_shape(s) == (1, 1, 0, 2, 2) and reqs[1].is_finished
    assert s.kv_usage == pytest.approx(3 / 64) and (s.num_prompt_tokens, s.num_generation_tokens) == (16, 4)
    assert (s.num_decode_only_steps, s.decode_only_steps_s, s.mixed_steps_s) == (1, 1.0, 1.0)  # each step 1 s
    assert s.decode_only_rows == 2

    s = stats.step()
    assert _queue_shape(s) == (0, 1, 0, 2, 10) and reqs[0].is_finished
    assert s.kv_usage == pytest.approx(3 / 64) and (s.num_prompt_tokens, s.num_generation_tokens) == (25, 6)

    s = stats.step()
    assert _queue_shape(s) == (0, 0, 0, 1, 1) and s.kv_usage == 0.0 and s.num_free_blocks == 64
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_steps) == (25, 7, 4)
    assert (s.num_decode_only_steps, s.decode_only_steps_s, s.mixed_steps_s) == (2, 2.0, 2.0)  # steps 2 and 4
    assert s.decode_only_rows == 2 + 1
    assert s.prefix_cache_hit_rate == 0.0 and s.num_preemptions_swap == s.num_preemptions_recompute == 0


def test_stats_count_swapped_requests_and_blocks():
    """4 blocks of 4, swap mode: two 7-token prompts fill the cache; in step 3 the late one is
    swapped out (2 blocks) while the early one finishes; in step 4 it is swapped back in."""
    sched = make_scheduler(num_blocks=4, block_size=BS, num_host_blocks=4, preemption_mode="swap")
    stats = _Steps(sched)
    early = make_request(prompt=_prompt(100, 7), max_tokens=3, arrival_time=1.0)
    late = make_request(prompt=_prompt(200, 7), max_tokens=3, arrival_time=2.0)
    sched.add_request(early)
    sched.add_request(late)
    s = stats.step()
    assert s.kv_usage == 1.0 and s.num_free_blocks == 0
    stats.step()
    s = stats.step()
    assert _queue_shape(s) == (0, 0, 1, 1, 1)  # early decoded alone and finished; late is swapped out
    assert (s.num_preemptions_swap, s.num_blocks_swapped_out, s.num_blocks_swapped_in) == (1, 2, 0)
    assert s.kv_usage == 0.0
    s = stats.step()
    assert _queue_shape(s) == (0, 0, 0, 1, 1) and late.is_finished
    assert (s.num_preemptions_swap, s.num_preemptions_recompute, s.num_blocks_swapped_out,
            s.num_blocks_swapped_in, s.num_recomputed_tokens) == (1, 0, 2, 2, 0)
    assert s.num_generation_tokens == 6 and s.num_prompt_tokens == 14


@pytest.mark.parametrize("case", [
    "chunked-no-preemption",
    "recompute-after-outputs",
])
def test_prompt_token_count_equals_the_prompt_positions_computed(case):
    """num_prompt_tokens ("prompt tokens computed, prefix-cache hits excluded") must equal the prompt
    positions actually scheduled, however the prefill is chunked and whether or not it is a
    recompute after preemption (a recompute computes the prompt again)."""
    if case == "chunked-no-preemption":
        sched = make_scheduler(num_blocks=64, block_size=BS, max_num_batched_tokens=5, enable_prefix_caching=False)
    else:  # the late request is preempted with 8 computed tokens and re-prefills 9 in one chunk
        sched = make_scheduler(num_blocks=4, block_size=BS, preemption_mode="recompute", enable_prefix_caching=False)
    stats = _Steps(sched)
    for i, n in enumerate([7, 7]):
        sched.add_request(make_request(prompt=_prompt(100 * (i + 1), n), max_tokens=3, arrival_time=float(i)))
    prompt_positions = 0
    while sched.has_unfinished():
        out = sched.schedule()
        prompt_positions += sum(max(0, min(s.start_pos + len(s.token_ids), s.request.num_prompt_tokens) - s.start_pos)
                                for s in out.scheduled)
        sched.update_from_output(out, sampled(out))
    s = stats.snapshot()
    assert (s.num_preemptions_recompute > 0) == (case != "chunked-no-preemption")
    assert s.num_prompt_tokens == prompt_positions


# ---- through the engine ------------------------------------------------------------------------
def test_engine_stats_and_request_timings_on_the_tiny_model(tiny_llama):
    """Three distinct prompts (20, 12, 16 tokens), 4 greedy outputs each, two sequence slots.
    1. First step: two prefills in one batch (32 tokens), the third request waits.
    2. Run to the end: totals equal the workload, the cache is empty, and every request's timings
       are ordered arrival <= first scheduled <= first token <= finished, the third request
       scheduled only after the first two produced their first token."""
    engine = LLMEngine.from_engine_args(tiny_llama, max_num_seqs=2, block_size=BS, num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    lens = [20, 12, 16]
    for i, n in enumerate(lens):
        engine.add_request(str(i), _prompt(10 + 60 * i, n), params)
    s = engine.get_stats()
    assert (s.num_waiting, s.num_running, s.num_queued_tokens, s.num_steps) == (3, 0, 48, 0)

    finals, tokens = {}, {rid: [] for rid in "012"}
    outputs = engine.step()
    s = engine.get_stats()
    assert _queue_shape(s) == (1, 2, 0, 2, 32)
    assert s.num_free_blocks == 64 - (5 + 3) and s.kv_usage == pytest.approx(8 / 64)
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_queued_tokens) == (32, 2, 16)
    assert 0 <= s.scheduler_overhead_s <= s.step_latency_s
    assert (s.num_decode_only_steps, s.decode_only_rows, s.decode_only_steps_s, s.mixed_steps_s) == (
        0, 0, 0.0, s.step_latency_s)
    latencies = [s.step_latency_s]
    while True:
        for out in outputs:
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        latencies.append(engine.get_stats().step_latency_s)

    s = engine.get_stats()
    assert (s.num_waiting, s.num_running, s.num_swapped, s.kv_usage) == (0, 0, 0, 0.0)
    assert (s.num_prompt_tokens, s.num_generation_tokens) == (sum(lens), 4 * len(lens))
    assert s.num_steps == 4 + 4  # r0, r1 together in 4 steps, then r2 alone in 4 (one per output)
    assert s.num_decode_only_steps == 3 + 3  # each group's steps after its prefill
    assert s.decode_only_rows == 3 * 2 + 3 * 1
    mixed = latencies[0] + latencies[4]  # the two prefills
    assert s.mixed_steps_s == pytest.approx(mixed) and s.decode_only_steps_s == pytest.approx(sum(latencies) - mixed)
    assert s.prefix_cache_hit_rate == 0.0 and s.batch_size == 1 and s.batch_tokens == 1
    for rid in "012":
        m, out = finals[rid].metrics, finals[rid]
        assert len(tokens[rid]) == 4 and out.num_cached_tokens == 0
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft == m.first_token_time - m.arrival_time and m.ttft >= 0
        assert m.queue_time >= 0 and m.e2e_latency >= m.ttft
    first_two = [finals[r].metrics for r in "01"]
    assert first_two[0].first_scheduled_time == first_two[1].first_scheduled_time  # the same step
    assert finals["2"].metrics.first_scheduled_time > max(m.first_token_time for m in first_two)
    assert finals["2"].metrics.queue_time > max(m.queue_time for m in first_two)


def test_engine_stats_report_preemptions_and_recomputed_tokens(tiny_llama):
    """A 12-block cache of 4 tokens and four 16-token prompts with 16 outputs each (8 blocks per
    request at the end): preemption is forced; every recompute counts the tokens it threw away."""
    engine = LLMEngine.from_engine_args(tiny_llama, block_size=BS, num_blocks=12, max_num_batched_tokens=64,
                                        preemption_mode="recompute", enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(str(i), _prompt(10 + 40 * i, 16), SamplingParams(max_tokens=16, temperature=0,
                                                                            ignore_eos=True))
    thrown_away = 0
    while engine.has_unfinished_requests():
        before = {r.request_id: (r, r.num_computed_tokens, r.num_preemptions) for r in engine.scheduler.running}
        engine.step()
        thrown_away += sum(n for r, n, p in before.values() if r.num_preemptions > p)
        s = engine.get_stats()
        assert s.num_running + s.num_waiting + s.num_swapped == len(engine.scheduler.requests)
    s = engine.get_stats()
    assert s.num_preemptions_recompute > 0 and s.num_preemptions_swap == 0
    assert s.num_recomputed_tokens == thrown_away
    assert s.num_generation_tokens == 4 * 16
