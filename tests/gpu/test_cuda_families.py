"""Every model family on CUDA (marked `gpu`: `make test-gpu`): on the Triton path in bfloat16 (sliding
windows and soft-caps in the paged kernel, experts as one grouped matmul each for gate/up and
down) each is as faithful to float32 as transformers' own bfloat16, with chunked prefill and swap
preemption on, and CUDA graphs on and off give the same tokens; the families served through
transformers' own modeling code too."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import NATIVE_ARCHS, TRANSFORMERS_ARCHS, save_tiny_model
from tests.engine.helpers import assert_as_faithful_as_transformers, hf_greedy

pytestmark = pytest.mark.gpu

MAX_NEW = 24
FEATURES = dict(num_blocks=120, block_size=4, max_num_batched_tokens=32, preemption_mode="swap")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 300) for _ in range(30)]
    return ([[rng.randrange(3, 300) for _ in range(rng.randint(3, 70))] for _ in range(6)]
            + [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))] for _ in range(4)])


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", NATIVE_ARCHS + TRANSFORMERS_ARCHS)
def test_every_family_in_bfloat16_on_the_triton_path_is_as_faithful_as_transformers(arch, prompts, tmp_path):
    model = save_tiny_model(tmp_path / arch, arch, hidden_size=128, intermediate_size=256, head_dim=32)
    reference = hf_greedy(model, prompts, MAX_NEW, device="cuda", dtype=torch.bfloat16, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(model, device="cuda", attention_backend="triton", enforce_eager=eager, **FEATURES)
        assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
        runs[eager] = _greedy(llm, prompts)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert_as_faithful_as_transformers(model, prompts, runs[False], reference, device="cuda")
    assert runs[False] == runs[True]
