"""Adaptive step size: the step-time model, the budget it sets under target_step_latency_s, and
decodes that never skip a step behind a prefill chunk."""
from __future__ import annotations

import itertools

from engine import LLM, SamplingParams
from engine.scheduler.scheduler import MIN_PREFILL_CHUNK
from engine.scheduler.step_time import StepTimeModel
from tests.engine.helpers import make_request, make_scheduler, step


def _cost(tokens: int, fixed: float = 0.010, per_token: float = 0.001) -> float:
    return fixed + per_token * tokens


def test_step_time_model_learns_fixed_and_per_token_cost_and_follows_a_change():
    model = StepTimeModel()
    assert model.tokens_within(0.05) is None  # nothing measured yet
    sizes = itertools.cycle([8, 40, 200, 17])
    for _ in range(40):
        tokens = next(sizes)
        model.observe(tokens, _cost(tokens))
    fixed, per_token = model.fit()
    assert abs(fixed - 0.010) < 1e-6 and abs(per_token - 0.001) < 1e-9
    assert model.tokens_within(0.05) == 40
    for _ in range(120):  # the machine becomes twice as slow
        tokens = next(sizes)
        model.observe(tokens, 2 * _cost(tokens))
    assert abs(model.tokens_within(0.05) - 15) <= 1  # (0.05 - 0.02) / 0.002


def test_step_time_model_charges_everything_per_token_when_steps_never_vary():
    model = StepTimeModel()
    for _ in range(10):
        model.observe(8, 0.08)
    assert model.fit() == (0.0, 0.01)
    assert model.tokens_within(0.16) == 16


def _trained(sched, fixed: float = 0.010, per_token: float = 0.001):
    for tokens in [8, 40, 200, 17] * 3:
        sched.observe_step(tokens, _cost(tokens, fixed, per_token))
    return sched


def test_target_latency_sizes_prefill_chunks_around_running_decodes():
    """1. Four requests decode. 2. A 1,000-token prompt arrives. Under a 50 ms target (40
    tokens by the model) every step runs all four decodes plus a 36-token chunk, until the
    prompt is in; without a target the chunk is the whole 512-token budget minus the decodes."""
    for target, chunk in ((0.05, 36), (None, 508)):
        sched = make_scheduler(max_num_batched_tokens=512, block_size=4, num_blocks=1024,
                               target_step_latency_s=target)
        _trained(sched)
        decoding = [make_request(5, max_tokens=100) for _ in range(4)]
        for r in decoding:
            sched.add_request(r)
        step(sched)  # their prompts
        long = make_request(1000, max_tokens=4)
        sched.add_request(long)
        prefilled = 0
        while prefilled < 1000:
            out = step(sched)
            counts = out.num_scheduled_tokens
            assert all(counts[r.request_id] == 1 for r in decoding)
            assert counts[long.request_id] == min(chunk, 1000 - prefilled)
            prefilled += counts[long.request_id]


def test_target_below_what_the_decodes_need_still_lets_prompts_progress():
    sched = make_scheduler(max_num_batched_tokens=512, block_size=4, num_blocks=1024, target_step_latency_s=0.001)
    decoding = [make_request(5, max_tokens=100) for _ in range(6)]
    for r in decoding:
        sched.add_request(r)
    step(sched)  # untrained: the whole budget
    _trained(sched)  # a 1 ms target is below the 10 ms fixed cost
    long = make_request(100, max_tokens=4)
    sched.add_request(long)
    assert sched.token_budget() == 6 + MIN_PREFILL_CHUNK
    out = step(sched)
    assert out.num_scheduled_tokens[long.request_id] == MIN_PREFILL_CHUNK


def test_a_prefill_chunk_leaves_room_for_the_decodes_ranked_behind_it():
    """1. Three priority-1 requests decode. 2. A priority-0 prompt of 200 tokens arrives and,
    running, ranks first. 3. With a 20-token budget every step gives each decode its token and
    the chunk 17, where the chunk used to take all 20 and the decodes skipped the step."""
    sched = make_scheduler(policy="priority", max_num_batched_tokens=20, block_size=4, num_blocks=256)
    short = [make_request(3, max_tokens=50, priority=1) for _ in range(3)]
    for r in short:
        sched.add_request(r)
    step(sched)
    long = make_request(200, max_tokens=4, priority=0)
    sched.add_request(long)
    for _ in range(5):
        counts = step(sched).num_scheduled_tokens
        assert all(counts[r.request_id] == 1 for r in short)
        assert counts[long.request_id] == 17


def test_engine_feeds_the_model_and_keeps_greedy_output(tiny_llama):
    prompts = [[3 + (i * 7 + j) % 200 for j in range(20 + 15 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, target_step_latency_s=1e-4)  # far below a step: minimal chunks every step
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.step_time.fit() is not None
    assert llm.engine.scheduler.token_budget() < 512
