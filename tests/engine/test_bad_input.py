"""Bad input is a ValueError naming the field; the engine keeps serving everything else."""
from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("top_k", -3),
    ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("logprobs", 50),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(tiny_llama, max_model_len=64, num_blocks=12, block_size=4)


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt"), ([], "prompt_token_ids"), (list(range(3, 80)), "context length"),
    ([5, 10**6], "prompt_token_ids"), ([5, -1], "prompt_token_ids"), ([5, True], "prompt_token_ids"),
    ([5, 6.0], "prompt_token_ids"),
])
def test_invalid_prompts_raise_and_engine_keeps_serving(engine, prompt, match):
    """1. Start a valid request. 2. A bad one raises ValueError. 3. The valid one finishes with the
    tokens it gets when run alone, and every block is free again."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.add_request("alone", [7, 8, 9], params)
    alone = _run(engine)["alone"]
    engine.add_request("good", [7, 8, 9], params)
    first = engine.step()[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert first + _run(engine)["good"] == alone
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_request_that_can_never_fit_is_rejected(engine):
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("huge", list(range(3, 50)), SamplingParams(max_tokens=300))
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    _run(engine)


def _run(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                tokens.setdefault(out.request_id, []).extend(o.token_ids)
    return tokens
