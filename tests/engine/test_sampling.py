"""Sampling through the real engine: seeds, top-k, stops, lengths, logprobs."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 3, 120], [8, 8, 30, 200, 11], [250, 4, 66, 90, 91, 92, 93, 14, 15]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_batched_tokens=64)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fixed_seed_repeats_and_ignores_batch_composition(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _tokens(llm, [PROMPTS[0]], params)[0]
    assert _tokens(llm, [PROMPTS[0]], params)[0] == alone
    others = [SamplingParams(max_tokens=n, temperature=0.9, ignore_eos=True) for n in (5, 30)]
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], params, others[1]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert _tokens(llm, [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=1.0, seed=99,
                                                       ignore_eos=True))[0] != alone


def test_top_k_one_equals_greedy(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    assert _tokens(llm, PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, top_k=1)) == greedy


def test_stop_string_ends_output_with_stop_and_is_not_included(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 12
    stop = full.text[8:11]
    cut = full.text[:full.text.find(stop)]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == cut


def test_stop_token_ids_end_output(llm):
    full = _tokens(llm, [PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = full[6]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:full.index(stop_id) + 1]


def test_max_tokens_gives_length(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.7, ignore_eos=True), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5 for o in outs)


def test_logprobs_cover_sampled_and_top_tokens(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and len(entry) == 3  # greedy token is also the top-1
        assert entry[token_id] == max(entry.values()) <= 0


def test_heterogeneous_params_share_one_batch(llm):
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=1.5, top_p=0.5,
              seed=3), SamplingParams(max_tokens=8, temperature=0.7, min_p=0.2, repetition_penalty=1.3, seed=4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _tokens(llm, [PROMPTS[0]], params[0])[0]
    assert outs[1].outputs[0].token_ids == _tokens(llm, [PROMPTS[1]], params[1])[0]
