"""Prompt logprobs: each prompt token's logprob (the first's None) and the top ones equal
transformers' log-softmax of the previous position's logits, whole or in prefill chunks, beside
requests that ask for none, under preemption (recomputed positions are not scored twice), once per
request with n > 1; the sampled tokens do not change; the prefix cache serves no token still to be
scored, and serves the prompt again once it is."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

PROMPTS = ["the cat sat on a mat while dogs ran fast over green hills",
           "stars as people sang songs about old ships sailing far away under bright stars",
           "blue lakes"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)
    return logprobs


def _check(output, reference, k: int) -> None:
    ids, scored = output.prompt_token_ids, output.prompt_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    ref = reference(ids)
    for i in range(1, len(ids)):
        assert scored[i][ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(k)
        assert set(scored[i]) == set(top.indices.tolist()) | {ids[i]}
        assert [scored[i][t] for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 8, "block_size": 4}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_llama, reference, engine_args):
    llm = LLM(tiny_llama, **engine_args)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    params = [SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=k) for k in (3, 0)] + [
        SamplingParams(max_tokens=6, temperature=0)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    _check(outputs[0], reference, 3)
    _check(outputs[1], reference, 0)
    assert outputs[2].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_scored_tokens_are_computed_not_served_by_the_prefix_cache(tiny_llama, reference):
    llm = LLM(tiny_llama, block_size=4)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)  # the prompt's blocks now cached
    [scored] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert scored.num_cached_tokens == 0
    _check(scored, reference, 1)
    [again] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert again.num_cached_tokens > 0


def test_prompt_logprobs_come_once_with_n_and_survive_preemption(tiny_llama, reference):
    tight = LLM(tiny_llama, num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, n=3, prompt_logprobs=2, ignore_eos=True)
    outputs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.engine.get_stats().num_preemptions_recompute > 0
    for output in outputs:
        assert len(output.outputs) == 3
        _check(output, reference, 2)
    tight.engine.kv.check_integrity()
    assert tight.engine.kv.num_free_blocks == tight.engine.kv.num_blocks


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(prompt_logprobs=21)
    assert raised.value.param == "prompt_logprobs"
