"""Greedy token-for-token parity with transformers' generate, under every scheduling feature."""
from __future__ import annotations

import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.engine.helpers import hf_greedy

MAX_NEW = 24


def _prompts(num: int, seed: int = 0, lo: int = 3, hi: int = 60, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model_and_reference(request):
    model_dir = request.getfixturevalue(request.param)
    prompts = _prompts(8)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=64),
    dict(max_num_seqs=1),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunks smaller than most prompts
    dict(max_num_seqs=3, max_num_batched_tokens=7, block_size=4),
    dict(max_num_seqs=64, enable_prefix_caching=False),
    dict(policy="static", max_num_seqs=4),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="auto", policy="priority"),
    dict(max_num_seqs=64, max_num_batched_tokens=16, attention_backend="torch"),  # pure torch: gather + buckets
    dict(max_num_seqs=64, max_num_batched_tokens=16, attention_backend="cpu"),  # C++ decode kernel
    dict(max_num_seqs=64, target_step_latency_s=1e-4),  # adaptive budget: minimal chunks around decodes
    dict(max_num_seqs=64, async_scheduling=True),  # steady decodes run a step ahead of their tokens
    dict(max_num_seqs=1, async_scheduling=True),
    dict(max_num_seqs=3, max_num_batched_tokens=7, block_size=4, async_scheduling=True),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="auto", policy="priority",
         async_scheduling=True),
], ids=["batch64", "batch1", "chunked16", "chunked7-bs4", "no-prefix-cache", "static", "preempt-swap",
        "preempt-recompute", "preempt-auto", "torch-attention", "cpu-kernel-attention", "adaptive-step",
        "async-batch64", "async-batch1", "async-chunked7-bs4", "async-preempt-auto"])
def test_greedy_matches_transformers(model_and_reference, engine_args):
    model_dir, prompts, expected = model_and_reference
    llm = LLM(model_dir, **engine_args)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if "preemption_mode" in engine_args:  # the tiny pool really forced preemptions
        stats = llm.engine.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_requests_joining_mid_flight(model_and_reference):
    """1. Start half the requests. 2. After a few steps add the rest, one per step.
    3. Every request's tokens still equal transformers'."""
    model_dir, prompts, expected = model_and_reference
    engine = LLMEngine.from_engine_args(model_dir, max_num_batched_tokens=32)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    for i, prompt in pending[:4]:
        engine.add_request(str(i), prompt, GREEDY)
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
    for i, prompt in pending[4:]:
        engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_n_samples_at_temperature_zero_all_equal_greedy(model_and_reference):
    model_dir, prompts, expected = model_and_reference
    llm = LLM(model_dir, max_num_batched_tokens=32, block_size=4)
    outputs = llm.generate(prompts[:4], SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    for out, ref in zip(outputs, expected):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert all(o.token_ids == ref for o in out.outputs)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_text_equals_tokenizer_decode(tiny_llama):
    llm = LLM(tiny_llama)
    out = llm.generate("the cat sat on", SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == llm.tokenizer.encode("the cat sat on")
