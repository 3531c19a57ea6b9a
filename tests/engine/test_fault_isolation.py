"""Fault isolation: a request that fails while running (in sampling, in the stop check, in
detokenization) fails alone. Its batch-mates get exactly the tokens they get without it, its
blocks are freed, and the engine goes on. Extreme sampling values either are refused up front
with InvalidRequestError or run to completion, never break a batch."""
from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.sampler as sampler_module
from engine import AsyncEngine, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError, RequestFailedError
from engine.output_processor import OutputProcessor
from engine.scheduler.scheduler import Scheduler
from tests.engine.helpers import run_steps

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
PROMPTS = {"a": [5, 17, 42, 99], "b": [8, 8, 30], "c": [250, 4, 66, 90, 91], "bad": [3, 9, 27]}
MATES = {"a": GREEDY, "b": SEEDED, "c": GREEDY}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(request, tiny_llama):
    return LLMEngine.from_engine_args(tiny_llama, max_num_batched_tokens=64, num_blocks=40, block_size=4,
                                      async_scheduling=request.param)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], flush_every: int = 1):
    outputs, errors = run_steps(engine, requests, flush_every)
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return {rid: [t for out in outs for o in out.outputs for t in o.token_ids] for rid, outs in outputs.items()}, errors


def _raise_for_bad(original, request_of):
    def wrapped(*args, **kwargs):
        if request_of(*args, **kwargs).request_id.startswith("bad"):
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)
    return wrapped


INJECTIONS = {  # where the fault strikes -> (owner, attribute, how to find the request in its arguments)
    "sampling": (sampler_module, "_gathered",  # the batch's rows: it strikes any batch holding the request
                 lambda token_ids, raw, requests, rows: next((r for r in requests if r.request_id.startswith("bad")),
                                                       requests[0])),
    "stop-check": (Scheduler, "_stop_reason", lambda self, request: request),
    "detokenization": (OutputProcessor, "_append", lambda self, sample, request, *_: request),
}


@pytest.mark.parametrize("where", list(INJECTIONS))
def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch, where):
    """1. Three requests (greedy and seeded) run alone: reference tokens. 2. The same three run
    beside a fourth whose sampling / stop check / detokenization raises on its first token.
    3. The fourth gets a RequestFailedError naming the fault; the others' tokens are unchanged;
    every block is free; the engine counts one failed request and keeps serving."""
    reference, _ = _run(engine, {rid: (PROMPTS[rid], p) for rid, p in MATES.items()})
    owner, name, request_of = INJECTIONS[where]
    monkeypatch.setattr(owner, name, _raise_for_bad(getattr(owner, name), request_of))
    failed_before = engine.get_stats().num_failed_requests
    batch = {rid: (PROMPTS[rid], p) for rid, p in MATES.items()} | {"bad": (PROMPTS["bad"], GREEDY)}
    tokens, errors = _run(engine, batch)
    assert set(errors) == {"bad"} and isinstance(errors["bad"], RequestFailedError)
    assert "injected fault" in str(errors["bad"])
    assert {rid: tokens[rid] for rid in MATES} == reference
    assert engine.get_stats().num_failed_requests == failed_before + 1
    assert (engine.get_stats().num_steps_ahead > 0) == engine.runs_ahead
    monkeypatch.undo()
    assert _run(engine, {"after": (PROMPTS["a"], GREEDY)})[0]["after"] == reference["a"]


def test_a_fault_detokenizing_held_tokens_fails_that_request_alone(engine, monkeypatch):
    """Between flushes a running request's tokens are detokenized only when its delta goes out:
    a fault there (the tokens of several steps appended at once) fails it alone, as one in its
    own step does."""
    reference, _ = _run(engine, {rid: (PROMPTS[rid], p) for rid, p in MATES.items()})
    append = OutputProcessor._append
    struck = []

    def held_fault(self, sample, request, logprobs, ends):
        if request.request_id == "bad" and request.num_output_tokens - len(sample.token_ids) > 1:
            struck.append(request.num_output_tokens)
            raise RuntimeError("injected fault")
        return append(self, sample, request, logprobs, ends)

    monkeypatch.setattr(OutputProcessor, "_append", held_fault)
    batch = {rid: (PROMPTS[rid], p) for rid, p in MATES.items()} | {"bad": (PROMPTS["bad"], GREEDY)}
    tokens, errors = _run(engine, batch, flush_every=4)
    assert struck and set(errors) == {"bad"} and "injected fault" in str(errors["bad"])
    assert len(tokens["bad"]) == 1  # its first token went out before the fault
    assert {rid: tokens[rid] for rid in MATES} == reference


def test_a_failed_sample_of_n_fails_its_whole_group(engine, monkeypatch):
    """n=3: the failing sample takes its siblings with it (one error for the user request), and
    a batch-mate is unaffected."""
    reference, _ = _run(engine, {"a": (PROMPTS["a"], GREEDY)})
    owner, name, request_of = INJECTIONS["stop-check"]
    monkeypatch.setattr(owner, name, _raise_for_bad(getattr(owner, name), request_of))
    tokens, errors = _run(engine, {"a": (PROMPTS["a"], GREEDY),
                                   "bad": (PROMPTS["bad"], SamplingParams(n=3, max_tokens=8, temperature=1.0))})
    assert set(errors) == {"bad"} and tokens["a"] == reference["a"]


# ---- extreme values ----------------------------------------------------------------------------
EXTREME_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**400,
                                True, False])
EXTREME_FLOATS = st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 1.0, 2.0, 1e300, -0.0, -1e-300, math.inf, -math.inf,
                                  math.nan, 3, "1.0", None])
EXTREME_KWARGS = st.fixed_dictionaries({}, optional={
    "n": EXTREME_INTS, "max_tokens": st.one_of(EXTREME_INTS, st.integers(1, 6)), "top_k": EXTREME_INTS,
    "seed": st.one_of(EXTREME_INTS, st.none()), "logprobs": st.one_of(EXTREME_INTS, st.none()),
    "temperature": EXTREME_FLOATS, "top_p": EXTREME_FLOATS, "min_p": EXTREME_FLOATS,
    "presence_penalty": EXTREME_FLOATS, "frequency_penalty": EXTREME_FLOATS, "repetition_penalty": EXTREME_FLOATS,
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=4), max_size=20), st.integers()),
    "stop_token_ids": st.one_of(st.none(), st.lists(EXTREME_INTS, max_size=3)),
    "ignore_eos": st.sampled_from([True, False, 1, "yes"]),
})


@pytest.fixture(scope="module")
def async_engine(tiny_llama):
    eng = AsyncEngine.from_engine_args(tiny_llama, max_num_batched_tokens=64, max_model_len=64)
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, request_id) -> list[int]:
    tokens = []
    async for out in eng.generate(prompt, params, request_id):
        tokens += [t for o in out.outputs for t in o.token_ids]
    return tokens


@pytest.fixture(scope="module")
def healthy_reference(async_engine) -> list[list[int]]:
    async def main():
        return [await _collect(async_engine, PROMPTS[rid], MATES[rid], f"ref-{rid}") for rid in ("a", "b")]
    return asyncio.run(main())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=EXTREME_KWARGS)
def test_extreme_sampling_values_are_refused_or_run_beside_healthy_requests(async_engine, healthy_reference,
                                                                            kwargs):
    """Each draw either raises InvalidRequestError naming a field at construction, or runs to its
    end beside two healthy requests (greedy and seeded), whose tokens equal their reference."""
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError as e:
        assert e.param in kwargs
        return
    params.max_tokens = min(params.max_tokens, 6)  # keep the run short; the value itself was accepted

    async def main():
        return await asyncio.gather(*(_collect(async_engine, PROMPTS[rid], MATES[rid], f"{rid}-{id(kwargs)}")
                                      for rid in ("a", "b")),
                                    _collect(async_engine, PROMPTS["bad"], params, f"x-{id(kwargs)}"))

    a, b, extreme = asyncio.run(main())
    assert [a, b] == healthy_reference
    assert 1 <= len(extreme) <= params.n * params.max_tokens
