"""dtype: `auto` per device, validation, and 16-bit greedy decoding on the CPU path."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.base import AttentionParams
from engine.attention.selector import resolve_kv_cache_dtype, select_backend
from engine.config import CacheConfig, ModelConfig
from tests.engine.helpers import assert_as_faithful_as_transformers, hf_greedy

MAX_NEW = 24


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert ModelConfig(device="cpu").resolved_dtype == "float32"
    assert ModelConfig(device="cuda").resolved_dtype == "bfloat16"
    assert ModelConfig(device="cpu", dtype="bfloat16").resolved_dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="fp8")
    with pytest.raises(ValueError, match="computes in float32"):
        ModelConfig(quantization="int8", dtype="bfloat16")


def test_the_kv_cache_dtype_is_the_models_unless_set_and_on_cuda_always_the_models():
    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32, torch.device("cpu")) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="keeps the model's dtype"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")


def test_an_fp16_kv_cache_holds_twice_the_blocks_in_the_same_memory_and_says_so(tiny_llama):
    """The pool is sized in bytes: fp16 blocks are half as large. Swap's host pool keeps the same
    dtype, and the report (the serve app's engine labels) names it; fp32 weights through an fp16
    cache are no longer the reference, and no check scores them, so no figures are claimed."""
    engines = {kv: LLM(tiny_llama, kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20, swap_space_bytes=1 << 20,
                       preemption_mode="swap") for kv in ("float32", "float16")}
    fp32, fp16 = (engines[kv].engine for kv in ("float32", "float16"))
    assert fp16.kv.pool.num_blocks == 2 * fp32.kv.pool.num_blocks
    assert fp16.runner.kv_cache.dtype == fp16.runner.host_cache.dtype == torch.float16
    blocks = fp16.runner.backend.block_dim()
    assert fp16.runner.host_cache.shape[blocks] == 2 * fp32.runner.host_cache.shape[blocks]
    assert (fp32.model_report.kv_cache_dtype, fp16.model_report.kv_cache_dtype) == ("float32", "float16")
    assert fp32.model_report.top1_agreement == 1.0 and fp16.model_report.top1_agreement is None
    recompute_only = LLM(tiny_llama, kv_cache_memory_bytes=1 << 20, swap_space_bytes=1 << 20).engine
    assert recompute_only.runner.host_cache.shape[blocks] == 1  # nothing is ever swapped out: no host pool


def test_flash_backend_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flash", torch.device("cpu"), torch.bfloat16, AttentionParams(0.125))
    with pytest.raises(ValueError, match="needs dtype float32"):
        select_backend("cpu", torch.device("cpu"), torch.bfloat16, AttentionParams(0.125))


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=16),  # prefill chunks attend to cached context
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
], ids=["chunked16", "preempt-swap"])
def test_bfloat16_greedy_is_as_faithful_as_transformers_bfloat16(tiny_llama, engine_args):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    llm = LLM(tiny_llama, dtype="bfloat16", **engine_args)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.backend.decode_kernel is None  # the C++ kernel is float32 only
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert_as_faithful_as_transformers(tiny_llama, prompts, [o.outputs[0].token_ids for o in outputs],
                                       hf_greedy(tiny_llama, prompts, MAX_NEW, dtype=torch.bfloat16, ignore_eos=True))
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
