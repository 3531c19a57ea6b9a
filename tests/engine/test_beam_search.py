"""Beam search equals transformers' generate(num_beams=w, do_sample=False, num_return_sequences=w):
every returned beam, in order, for widths 1-5, length penalties positive, zero and negative, beams
ending at EOS (two EOS ids) and at the length; with chunked prefill, a KV cache too small for a
step's beams at once, no prefix cache, and speculative decoding on; beside sampled requests in
the same batches. Each step computes one token per beam: a beam shares
the blocks of the beam it extends, the partial last one copy-on-write; none is leaked, also when
a search is aborted."""
from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM
from engine.beam_search import BeamSearchParams
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_model

PROMPTS = ["the cat sat on a mat", "dogs ran fast", "stars as people sang songs about old ships sailing",
           "green hills and blue lakes"]


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory) -> str:
    """A tiny Llama whose second EOS is a token its beams often hold, so beams end at EOS at
    many lengths (and the early-stop rule is exercised), not only at max_tokens."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-beams"), "llama")
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    seen = collections.Counter()
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = hf.generate(ids, num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=20,
                          attention_mask=torch.ones_like(ids))
        for row in out[:, ids.shape[1] + 2:].tolist():
            seen.update(set(row))
    hf.generation_config.eos_token_id = [tokenizer.eos_token_id, seen.most_common(1)[0][0]]
    hf.generation_config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(beam_model):
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(beam_model, dtype=torch.float32), \
        AutoTokenizer.from_pretrained(beam_model)

    def beams(prompt: str, width: int, max_tokens: int, length_penalty: float) -> list[list[int]]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = hf.generate(ids, num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                          length_penalty=length_penalty, attention_mask=torch.ones_like(ids))
        eos = set(hf.generation_config.eos_token_id)
        rows = []
        for row in out[:, ids.shape[1]:].tolist():  # each row padded after its EOS
            ends = [i for i, t in enumerate(row) if t in eos]
            rows.append(row[:ends[0] + 1] if ends else row)
        return rows
    return beams


def _check(llm: LLM, reference, width: int, max_tokens: int, length_penalty: float) -> collections.Counter:
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(width, max_tokens, length_penalty))
    reasons = collections.Counter()
    for prompt, out in zip(PROMPTS, outputs):
        assert [o.token_ids for o in out.outputs] == reference(prompt, width, max_tokens, length_penalty)
        assert [o.index for o in out.outputs] == list(range(width))
        assert [o.score for o in out.outputs] == sorted((o.score for o in out.outputs), reverse=True)
        reasons.update(o.finish_reason for o in out.outputs)
    return reasons


@pytest.fixture(scope="module")
def llm(beam_model) -> LLM:
    return LLM(beam_model, max_num_seqs=32)


@pytest.mark.parametrize("width,max_tokens,length_penalty", [(1, 10, 1.0), (2, 12, 1.0), (4, 20, 1.0),
                                                              (4, 16, 0.5), (3, 30, 2.0), (5, 25, -1.0),
                                                              (4, 14, 0.0)])
def test_beam_search_equals_transformers(llm, reference, width, max_tokens, length_penalty):
    _check(llm, reference, width, max_tokens, length_penalty)


def test_beams_end_at_eos_and_at_the_length(llm, reference):
    assert set(_check(llm, reference, 4, 20, 1.0)) == {"stop", "length"}
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(4, 20))[0].outputs
    stopped = [o for o in out if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] in llm.engine.eos_token_ids for o in stopped)
    assert all(o.text == llm.tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True) for o in stopped)


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill, beams spread over steps
    {"num_blocks": 10, "block_size": 4, "max_num_seqs": 32},  # a step's 16 beams take turns in the cache
    {"enable_prefix_caching": False},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
    {"speculative_config": {"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 2}},
])
def test_beam_search_is_unchanged_by_chunking_a_tight_cache_no_prefix_cache_or_speculation(beam_model, reference,
                                                                                          engine_args):
    llm = LLM(beam_model, **engine_args)
    _check(llm, reference, 4, 20, 1.0)
    if engine_args.get("num_blocks"):  # parked beams gave their blocks up to siblings that needed them
        assert llm.engine.get_stats().num_recomputed_tokens > 0
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_each_step_computes_one_token_per_beam_sharing_the_tail_copy_on_write(beam_model, reference,
                                                                              enable_prefix_caching):
    llm = LLM(beam_model, block_size=4, enable_prefix_caching=enable_prefix_caching)
    schedule, copies = llm.engine.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        copies.extend(out.blocks_to_copy)
        return out
    llm.engine.scheduler.schedule = recording_schedule
    _check(llm, reference, 4, 20, 1.0)
    stats = llm.engine.get_stats()
    num_prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    # every beam samples once: after the prompt, each beam of each step computed its one new token
    assert stats.num_prompt_tokens == num_prompt_tokens + stats.num_generation_tokens - len(PROMPTS)
    assert copies  # beams extending one beam write its shared, partial last block: copied first
    assert not llm.engine.scheduler.parked and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.engine.kv.check_integrity()


def test_searches_and_sampled_requests_share_the_batches_unchanged(llm, reference):
    sampled = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=9, temperature=1.0, seed=3)]
    alone = [llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0].token_ids for p in sampled]
    engine = llm.engine
    engine.add_request("search0", PROMPTS[0], BeamSearchParams(3, 15))
    for i, p in enumerate(sampled):
        engine.add_request(f"sampled{i}", PROMPTS[1], p)
    engine.add_request("search1", PROMPTS[3], BeamSearchParams(2, 10))
    outputs, batch_sizes = {}, []
    while engine.has_unfinished_requests():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event)
        batch_sizes.append(engine.get_stats().batch_size)
    assert max(batch_sizes) >= 3 + 2 + 2  # the beams of both searches and both samples in one step
    for i in range(2):
        assert sum((e.outputs[0].token_ids for e in outputs[f"sampled{i}"]), []) == alone[i]
    for request_id, prompt, width, max_tokens in [("search0", PROMPTS[0], 3, 15), ("search1", PROMPTS[3], 2, 10)]:
        (final,) = outputs[request_id]
        assert [o.token_ids for o in final.outputs] == reference(prompt, width, max_tokens, 1.0)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_beam_search_aborted_mid_way_frees_every_block(llm):
    llm.engine.add_request("search", PROMPTS[2], BeamSearchParams(4, 20))
    for _ in range(4):
        assert llm.engine.step() == []
    assert llm.engine.scheduler.running and llm.engine.kv.num_free_blocks < llm.engine.kv.num_blocks
    aborted = llm.engine.abort_request("search")
    assert aborted.finished and aborted.outputs == []
    assert not llm.engine.has_unfinished_requests() and "search" not in llm.engine.beams
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("params,field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty="long"), "length_penalty"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
])
def test_bad_beam_search_params_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequestError) as raised:
        BeamSearchParams(**params)
    assert raised.value.param == field


def test_a_beam_width_past_the_logprobs_the_engine_returns_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="beam_width must be at most 6") as raised:
        llm.beam_search(PROMPTS[0], BeamSearchParams(7, 4))  # two EOS ids: 3 candidates a beam, 20 at most
    assert raised.value.param == "beam_width"
    assert not llm.engine.has_unfinished_requests()
