"""The engine on CUDA (marked `gpu`: `make test-gpu` on a machine with an NVIDIA GPU).

float32 with the torch backend equals transformers on the same GPU token for token; bfloat16
(the CUDA default) with the flash backend (torch's FlashAttention-2 kernel) and with the torch
backend is as faithful to float32 as transformers' own bfloat16. Every scheduler feature is on
in some run: chunked prefill with cached context, prefix sharing, swap and recompute preemption.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import save_tiny_model
from tests.engine.helpers import assert_as_faithful_as_transformers, hf_greedy

pytestmark = pytest.mark.gpu

MAX_NEW = 24
FEATURES = [
    dict(max_num_seqs=64),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunks attend to cached context
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=32, preemption_mode="swap"),
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=32, preemption_mode="recompute", policy="priority"),
]
FEATURE_IDS = ["batch64", "chunked16", "preempt-swap", "preempt-recompute"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """head_dim 64, as real models have (the flash kernel's tile sizes)."""
    return save_tiny_model(tmp_path_factory.mktemp("gpu-llama"), "llama", hidden_size=256, intermediate_size=512,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(40)]  # a common prefix: prefix-cache hits
    fresh = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 90))] for _ in range(10)]
    return fresh + [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))] for _ in range(6)]


def _greedy(llm: LLM, prompts, ignore_eos: bool = False) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=ignore_eos)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_pool(llm: LLM, args: dict) -> None:
    engine = llm.engine
    if "preemption_mode" in args:  # the small pool really forced preemptions
        stats = engine.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("engine_args", FEATURES, ids=FEATURE_IDS)
def test_float32_greedy_equals_transformers_on_cuda(model_dir, prompts, engine_args):
    llm = LLM(model_dir, device="cuda", dtype="float32", **engine_args)
    assert llm.engine.runner.backend.name == "torch"  # flash attention has no float32 kernel
    assert _greedy(llm, prompts) == hf_greedy(model_dir, prompts, MAX_NEW, device="cuda")
    _check_pool(llm, engine_args)


@pytest.fixture(scope="module")
def bf16_reference(model_dir, prompts) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, MAX_NEW, device="cuda", dtype=torch.bfloat16, ignore_eos=True)


@pytest.mark.parametrize("backend", ["flash", "torch"])
@pytest.mark.parametrize("engine_args", FEATURES, ids=FEATURE_IDS)
def test_bfloat16_greedy_is_as_faithful_as_transformers_on_cuda(model_dir, prompts, bf16_reference, backend,
                                                               engine_args):
    llm = LLM(model_dir, device="cuda", attention_backend=backend, **engine_args)  # dtype auto: bfloat16
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.backend.name == backend
    outputs = _greedy(llm, prompts, ignore_eos=True)
    assert_as_faithful_as_transformers(model_dir, prompts, outputs, bf16_reference, device="cuda")
    _check_pool(llm, engine_args)


def test_auto_picks_flash_in_bfloat16_on_cuda(model_dir):
    llm = LLM(model_dir, device="cuda")
    assert (llm.engine.runner.backend.name, llm.engine.runner.kv_cache.dtype) == ("flash", torch.bfloat16)
    assert llm.engine.runner.kv_cache.device.type == "cuda"


def test_sampling_on_cuda_is_seeded_and_batch_independent(model_dir, prompts):
    """Every sampling setting runs on the GPU's tensors; a seeded request's tokens do not depend
    on its batch-mates (float32 here: in bfloat16 a batch's shape may move a near tie); top_k=1
    is greedy."""
    llm = LLM(model_dir, device="cuda", dtype="float32")
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=7,
                            repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, logprobs=3,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([prompts[0]] + prompts[1:6], [seeded] + [others] * 5, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    assert len(alone.logprobs) == 16 and all(len(lp) >= 3 for lp in alone.logprobs)
    llm = LLM(model_dir, device="cuda")
    top1 = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=1, ignore_eos=True)
    sampled = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], top1, use_tqdm=False)]
    assert sampled == _greedy(llm, prompts[:4], ignore_eos=True)
