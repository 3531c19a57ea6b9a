"""Deltas held between flushes (the engine process's loop emits every 100 ms in the GPU config):
a running request's tokens wait in the output processor, those of a request with no stop string
and no logprobs undetokenized, and its next delta, its end or its abort carries them. Whatever
the flushes, each choice's tokens, text and finish reason are those of a run that emits every
step."""
from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from tests.engine.helpers import choices, run_steps

PROMPT = [5, 17, 42, 99]
REQUESTS = {  # those with no stop string and no logprobs go undetokenized between flushes
    "greedy": (PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    "seeded-n3": ([8, 8, 30], SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)),
    "stop-string": ([250, 4, 66], SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop=["e", "a"])),
    "logprobs": ([3, 9, 27], SamplingParams(max_tokens=18, temperature=0.8, seed=9, logprobs=2, ignore_eos=True)),
    "best-of": ([7, 7], SamplingParams(n=1, best_of=3, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)),
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(request, tiny_llama):
    return LLMEngine.from_engine_args(tiny_llama, max_num_batched_tokens=64, async_scheduling=request.param)


def _renamed(requests: dict, suffix: str) -> dict:
    return {f"{rid}-{suffix}": value for rid, value in requests.items()}


@pytest.mark.parametrize("flush_every", [3, 7, 1000])
def test_held_steps_give_each_choice_the_tokens_and_text_of_unheld_ones(engine, flush_every):
    """Also the logprobs, and no token more generated: a stop string is found in the step that
    samples it, not at a flush."""
    generated = engine.get_stats().num_generation_tokens
    each, errors = run_steps(engine, _renamed(REQUESTS, "each"))
    generated_each = engine.get_stats().num_generation_tokens - generated
    held, held_errors = run_steps(engine, _renamed(REQUESTS, f"held{flush_every}"), flush_every)
    assert engine.get_stats().num_generation_tokens - generated == 2 * generated_each
    assert not errors and not held_errors
    for rid in REQUESTS:
        assert choices(held[f"{rid}-held{flush_every}"]) == choices(each[f"{rid}-each"]), rid
    assert sum(map(len, held.values())) < sum(map(len, each.values()))  # the deltas were held
    assert all(outs[-1].finished for outs in held.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_abort_between_flushes_returns_every_token_so_far(engine):
    """Aborted after 12 steps with none flushed since its first token: its final output carries
    the 11 tokens since, as the abort of a run that emits every step does."""
    long = SamplingParams(max_tokens=200, temperature=0.9, seed=4, ignore_eos=True)
    runs = {}
    for name, flush_every in (("each", 1), ("held", 1000)):
        outputs, _ = run_steps(engine, {name: (PROMPT, long), f"{name}-mate": (PROMPT[:3], long)}, flush_every,
                               max_steps=12)
        outputs[name].append(engine.abort_request(name))
        engine.abort_request(f"{name}-mate")
        while engine.has_unfinished_requests():  # the step launched ahead, if any: dropped
            engine.step()
        runs[name] = outputs[name]
    assert len(runs["held"]) == 2  # its first token, then everything else with the abort
    (tokens, text, reason, _), = choices(runs["held"]).values()
    assert (tokens, text, reason) == choices(runs["each"])[0][:3] and reason == "abort"
    assert len(tokens) == 12 and text
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
