"""Sampling through the real engine: seeds, top-k, stops, lengths, logprobs, logit_bias, min_tokens."""
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
    kept = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert (kept.finish_reason, kept.text, kept.stop_string) == ("stop", cut + stop, stop)


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


def test_logit_bias_forces_and_forbids_tokens_in_greedy_and_sampled_rows(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = _tokens(llm, [PROMPTS[0]], greedy)[0]
    forced = _tokens(llm, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                       logit_bias={77: 100}))[0]
    assert forced == [77] * 12 != free
    banned = _tokens(llm, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                       logit_bias={free[0]: -100}))[0]
    assert banned[0] != free[0] and free[0] not in banned
    sampled = _tokens(llm, PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True,
                                                   logit_bias={free[0]: -100, 3: -100}))
    assert all(free[0] not in out and 3 not in out for out in sampled)
    with pytest.raises(ValueError, match="logit_bias"):  # the vocabulary is the engine's to check
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={llm.engine.vocab_size: 1.0}), use_tqdm=False)


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(llm):
    eos = min(llm.engine.scheduler.eos_token_ids)
    wants_eos = {eos: 100}  # EOS would end the output at once
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, logit_bias=wants_eos),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, logit_bias=wants_eos, min_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and eos not in out.token_ids[:6]
    assert out.finish_reason == "stop"

    full = _tokens(llm, [PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    held = _tokens(llm, [PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                     stop_token_ids=[full[2]], min_tokens=8))[0]
    assert held[:2] == full[:2] and full[2] not in held[:8] and len(held) >= 8

    text = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = text.text[2:5]
    late = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                   min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 20 and late.token_ids[:20] == text.token_ids[:20]


def test_logit_bias_and_min_tokens_keep_greedy_output_under_speculative_decoding(tiny_llama, llm):
    params = [SamplingParams(max_tokens=16, temperature=0, logit_bias={5: 8.0, 17: -100}, min_tokens=10),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias={42: 5.0}),
              SamplingParams(max_tokens=16, temperature=0, min_tokens=16, stop_token_ids=[8, 30])]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for spec in ({"method": "ngram", "adaptive": False}, {"method": "self_draft", "adaptive": False}):
        spec_llm = LLM(tiny_llama, max_num_batched_tokens=64, speculative_config={**spec, "num_speculative_tokens": 3})
        assert [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, params, use_tqdm=False)] == expected
        assert spec_llm.engine.get_stats().num_spec_proposed_tokens > 0


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm):
    """A seeded sample is the same whichever request size it is drawn in, so best_of's samples are
    those of n=best_of: it returns the two of them its logprobs rank highest, as choices 0 and 1."""
    common = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    every = llm.generate(PROMPTS[0], SamplingParams(n=5, logprobs=0, **common), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda o: sum(lp[t] for t, lp in zip(o.token_ids, o.logprobs)), reverse=True)
    best = llm.generate(PROMPTS[0], SamplingParams(n=2, best_of=5, **common), use_tqdm=False)[0].outputs
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1] and all(o.logprobs is None for o in best)
    assert len({tuple(o.token_ids) for o in every}) > 2  # the ranking chose among different samples
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks  # every sample's blocks freed
