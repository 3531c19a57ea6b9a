"""Async scheduling: a steady batch of decodes has its next step launched before its tokens are read.

On the CPU the forward finishes before the host goes on, so these tests check what the step ahead
must not change: every token, logprob and end, the requests that end while their next step is in
flight, aborts, arrivals and every KV block. Its speed is a GPU's (BENCHMARKS.md).
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.engine.helpers import hf_greedy

MAX_NEW = 20


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(3, 40))] for _ in range(6)]


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama, prompts, MAX_NEW)  # cut after an end-of-sequence token


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request's outputs (RequestOutput deltas), stepping until none is left."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    deltas: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out)
    return deltas


def _tokens(deltas: list) -> list[int]:
    return [t for out in deltas for t in out.outputs[0].token_ids]


def _collect_samples(events: list, samples: dict[tuple[str, int], list[int]]) -> None:
    """Each sample's tokens, by (request id, sample index)."""
    for out in events:
        for o in out.outputs:
            samples.setdefault((out.request_id, o.index), []).extend(o.token_ids)


def _assert_no_block_held(engine: LLMEngine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_greedy_decodes_run_ahead_and_equal_transformers(tiny_llama, prompts, expected):
    """Different max_tokens: requests that end by length leave the step ahead, the rest go on;
    one that samples its end-of-sequence token ends there."""
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True)
    lengths = [MAX_NEW - 3 * i for i in range(len(prompts))]
    deltas = _run(engine, {str(i): (p, SamplingParams(max_tokens=n, temperature=0))
                           for i, (p, n) in enumerate(zip(prompts, lengths))})
    assert [_tokens(deltas[str(i)]) for i in range(len(prompts))] == [e[:n] for e, n in zip(expected, lengths)]
    assert all(sum(out.finished for out in deltas[str(i)]) == 1 and deltas[str(i)][-1].finished
               for i in range(len(prompts)))
    stats = engine.get_stats()
    assert MAX_NEW // 2 < stats.num_steps_ahead <= stats.num_decode_only_steps  # only decodes run ahead
    _assert_no_block_held(engine)


def test_a_request_that_stops_while_its_next_step_is_in_flight_ends_at_its_stop(tiny_llama, prompts, expected):
    """Each request stops on a token of its own output: the step already launched for it is dropped,
    its batch-mates go on, still a step ahead, and its blocks (the slot ahead included) are freed."""
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True)
    stops = [e[min(2 + i, len(e) - 1)] for i, e in enumerate(expected)]
    deltas = _run(engine, {str(i): (p, SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[s]))
                           for i, (p, s) in enumerate(zip(prompts, stops))})
    for i, (e, s) in enumerate(zip(expected, stops)):
        assert _tokens(deltas[str(i)]) == e[:e.index(s) + 1]
        assert deltas[str(i)][-1].outputs[0].finish_reason == "stop"
        assert sum(out.finished for out in deltas[str(i)]) == 1
    # the others' steps go on running ahead across each stop: every decode step after the first
    assert engine.get_stats().num_steps_ahead >= max(e.index(s) for e, s in zip(expected, stops)) - 1
    _assert_no_block_held(engine)


def test_seeded_sampling_and_logprobs_are_those_of_the_synchronous_engine(tiny_llama, prompts):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=7, logprobs=3, ignore_eos=True)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, async_scheduling=async_scheduling)
        runs[async_scheduling] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        _assert_no_block_held(llm.engine)
    assert llm.engine.get_stats().num_steps_ahead > 0
    for sync, ahead in zip(runs[False], runs[True]):
        assert ahead.token_ids == sync.token_ids
        assert [list(lp) for lp in ahead.logprobs] == [list(lp) for lp in sync.logprobs]
        assert all(a == pytest.approx(b, abs=1e-5) for x, y in zip(ahead.logprobs, sync.logprobs)
                   for a, b in zip(x.values(), y.values()))


def test_an_abort_while_a_step_is_in_flight_ends_that_request_alone(tiny_llama, prompts, expected):
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt, greedy)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(3)}
    while engine.get_stats().num_steps_ahead < 3:
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    final = engine.abort_request("1")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    num_before = len(tokens["1"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1"
            tokens[out.request_id] += out.outputs[0].token_ids
    assert tokens["0"] == expected[0] and tokens["2"] == expected[2]
    assert tokens["1"] == expected[1][:num_before]
    _assert_no_block_held(engine)


def test_an_arrival_waits_for_the_step_in_flight_and_then_joins(tiny_llama, prompts, expected):
    """A request added while a step is in flight stops the running ahead (the next step must admit
    it); once it decodes with the others, steps run ahead again."""
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    engine.add_request("0", prompts[0], greedy)
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    while engine.get_stats().num_steps_ahead < 3:
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    engine.add_request("1", prompts[1], greedy)
    ahead_at_arrival = engine.get_stats().num_steps_ahead
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    assert tokens == {"0": expected[0], "1": expected[1]}
    assert engine.get_stats().num_steps_ahead > ahead_at_arrival
    _assert_no_block_held(engine)


@pytest.mark.parametrize("reads_output", [dict(repetition_penalty=1.3), dict(min_tokens=MAX_NEW)],
                         ids=["penalty", "min_tokens"])
def test_requests_whose_sampling_reads_their_output_never_run_ahead(tiny_llama, prompts, reads_output):
    """Penalties and min_tokens read a request's output up to the token before: that token must be
    on the host first, so their batches step one at a time, with the synchronous engine's tokens."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, **reads_output)
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, async_scheduling=async_scheduling)
        outputs[async_scheduling] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.get_stats().num_steps_ahead == 0
    assert outputs[True] == outputs[False]


def test_a_stop_string_found_after_the_step_ahead_launched_ends_the_request_there(tiny_llama_words):
    """A stop string is found by detokenization, after the next step was launched: the request's
    text and tokens end as the synchronous engine's do."""
    prompts = ["the cat sat on the", "a dog ran to", "one two three"]
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    texts = [o.outputs[0].text for o in LLM(tiny_llama_words).generate(prompts, free, use_tqdm=False)]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, stop=[text.split()[2 + i]])
              for i, text in enumerate(texts)]
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama_words, async_scheduling=async_scheduling)
        runs[async_scheduling] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                  for o in llm.generate(prompts, params, use_tqdm=False)]
        _assert_no_block_held(llm.engine)
    assert llm.engine.get_stats().num_steps_ahead > 0
    assert runs[True] == runs[False]
    assert all(reason == "stop" and len(tokens) < MAX_NEW for _, tokens, reason in runs[True])


def test_samples_forked_from_a_one_token_prompt_equal_the_synchronous_engines(tiny_llama, prompts):
    """n=3 forks its samples after the first token. A one-token prompt arriving while others decode
    is a step of one-token rows, so a step is launched ahead for it before it forks: the forks
    share the parent's blocks, the slot ahead included, copy-on-write."""
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    forked = SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0.8, seed=3, ignore_eos=True)
    runs = {}
    for async_scheduling in (False, True):
        engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=async_scheduling)
        samples = runs[async_scheduling] = {}
        engine.add_request("a", prompts[0], greedy)
        engine.add_request("b", prompts[1], greedy)
        for _ in range(4):
            _collect_samples(engine.step(), samples)
        ahead_before = engine.get_stats().num_steps_ahead
        engine.add_request("n3", [42], forked)
        while engine.has_unfinished_requests():
            _collect_samples(engine.step(), samples)
        _assert_no_block_held(engine)
    assert engine.get_stats().num_steps_ahead > ahead_before > 0
    assert sorted(runs[True]) == sorted(runs[False]) and len(runs[True]) == 5
    assert runs[True] == runs[False]


def test_a_step_that_fails_with_a_step_in_flight_fails_every_request_and_the_engine_goes_on(
        tiny_llama, prompts, expected, monkeypatch):
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt, greedy)
    while engine.get_stats().num_steps_ahead < 2:
        engine.step()
    monkeypatch.setattr(engine.runner, "collect", lambda step: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    errors = engine.fail_all(RuntimeError("device lost"))
    assert sorted(e.request_id for e in errors) == ["0", "1", "2"]
    assert not engine.has_unfinished_requests()
    _assert_no_block_held(engine)
    monkeypatch.undo()
    assert _tokens(_run(engine, {"after": (prompts[0], greedy)})["after"]) == expected[0]


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_a_full_batch_runs_ahead_with_requests_queued_behind_it_unless_priority_could_preempt(
        tiny_llama, prompts, expected, policy):
    """max_num_seqs 2, six requests: while the batch is full no queued request could join the next
    step, so it runs ahead; under `priority` a queued request may displace a running one at any
    step, so a queue stops the running ahead. Every request's tokens are transformers'."""
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True, max_num_seqs=2, policy=policy)
    scheduler, ahead_with_queue = engine.scheduler, []
    schedule_ahead = scheduler.schedule_ahead

    def recorded(out):
        ahead = schedule_ahead(out)
        ahead_with_queue.append(ahead is not None and len(scheduler.waiting) > 0)
        return ahead

    scheduler.schedule_ahead = recorded
    deltas = _run(engine, {str(i): (p, SamplingParams(max_tokens=MAX_NEW, temperature=0))
                           for i, p in enumerate(prompts)})
    assert [_tokens(deltas[str(i)]) for i in range(len(prompts))] == expected
    assert any(ahead_with_queue) == (policy != "priority")
    assert engine.get_stats().num_steps_ahead > 0
    _assert_no_block_held(engine)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_with_stops_aborts_and_arrivals_equal_the_synchronous_engine(tiny_llama, seed):
    """Random prompts, lengths, stop tokens, seeded sampling and logprobs; requests arriving and
    aborted at random steps while steps run ahead. Each request that runs to its end gets the
    tokens the synchronous engine gives it; an aborted one a prefix of them; every block comes back."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(4, 9))]
    params = [SamplingParams(max_tokens=rng.randint(1, MAX_NEW), ignore_eos=rng.random() < 0.5,
                             temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randrange(100),
                             logprobs=rng.choice([None, 2])) for _ in prompts]
    sync = LLMEngine.from_engine_args(tiny_llama, async_scheduling=False)
    reference = {rid: _tokens(d) for rid, d in _run(sync, {str(i): (p, q) for i, (p, q) in
                                                           enumerate(zip(prompts, params))}).items()}
    for i, p in enumerate(params):  # stop on a token of the request's own output, somewhere in it
        tokens = reference[str(i)]
        if tokens and rng.random() < 0.5:
            stop = tokens[rng.randrange(len(tokens))]
            params[i] = dataclasses.replace(p, stop_token_ids=[stop])
            reference[str(i)] = tokens[:tokens.index(stop) + 1]
    engine = LLMEngine.from_engine_args(tiny_llama, async_scheduling=True, max_num_seqs=rng.choice([2, 4, 64]))
    arrivals = sorted((rng.randint(0, 6), str(i)) for i in range(len(prompts)))
    aborts = {rng.randint(1, 12): str(rng.randrange(len(prompts))) for _ in range(2)}
    tokens: dict[str, list[int]] = {}
    aborted, step = set(), 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, rid = arrivals.pop(0)
            engine.add_request(rid, prompts[int(rid)], params[int(rid)])
            tokens[rid] = []
        if step in aborts and aborts[step] in tokens and engine.abort_request(aborts[step]) is not None:
            aborted.add(aborts[step])
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
        step += 1
    for rid, got in tokens.items():
        expected_tokens = reference[rid]
        assert got == (expected_tokens[:len(got)] if rid in aborted else expected_tokens), rid
    _assert_no_block_held(engine)
