"""LoRA adapters on CUDA (marked `gpu`: `make test-gpu`): the Triton shrink/expand kernels over
the slots stacked on the device. In float32 an adapter's greedy tokens equal PEFT's merged model in
transformers on the GPU; in bfloat16 a batch mixing adapters and the base gives each request the
tokens it gets alone."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.lora import StackedLoraSlots
from tests.conftest import save_tiny_model
from tests.engine.helpers import hf_greedy
from tests.engine.test_lora import PROMPTS, make_adapter

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_on_cuda_equal_pefts_merged_model_and_mix_in_one_batch(tmp_path):
    base = save_tiny_model(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256, head_dim=32)
    adapters = {name: make_adapter(base, tmp_path / name, seed, merged_to=tmp_path / f"{name}-merged")
                for seed, name in enumerate(["a", "b", "c"])}
    modules = [f"{n}={p}" for n, p in adapters.items()]
    fp32 = LLM(base, device="cuda", dtype="float32", enable_lora=True, lora_modules=modules)
    assert _tokens(fp32.generate(PROMPTS, GREEDY, use_tqdm=False, lora="a")) == hf_greedy(
        str(tmp_path / "a-merged"), PROMPTS, 16, device="cuda", ignore_eos=True)
    assert isinstance(fp32.engine.runner.model.lora_slots, StackedLoraSlots)
    bf16 = LLM(base, device="cuda", enable_lora=True, lora_modules=modules)
    names = [None, "a", "b", "c", "a", None, "c", "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    together = _tokens(bf16.generate(prompts, GREEDY, use_tqdm=False, lora=names))
    alone = [_tokens(bf16.generate([p], GREEDY, use_tqdm=False, lora=n))[0] for p, n in zip(prompts, names)]
    assert together == alone
