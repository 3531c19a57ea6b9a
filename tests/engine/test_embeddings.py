"""Embeddings through the engine's real path (LLM.embed): the final hidden state of a prompt's last
token, or the mean over its tokens, L2-normalised, equal to transformers' own last hidden state
(after the model's final norm) for a native family and one run through transformers' code, under
chunked prefill, prefix caching, forced preemption and beside generation in the same steps, whose
tokens stay those of generation alone; truncated `dimensions`; refusals naming the field; every
KV block free at the end."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from tests.conftest import save_tiny_model
from tests.engine.test_families import shared_prefix_prompts


def _reference(model_dir: str, prompts: list[list[int]], pooling: str, dimensions: int | None = None
               ) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
            vector = hidden[-1] if pooling == "last" else hidden.mean(0)
            out.append(torch.nn.functional.normalize(vector[:dimensions], dim=0))
    return torch.stack(out)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp(f"embed-{request.param}"), request.param)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_states_under_chunking_caching_and_preemption(model_dir, pooling):
    prompts = shared_prefix_prompts(8)
    expected = _reference(model_dir, prompts, pooling)
    llm = LLM(model_dir, quantization="none", max_num_batched_tokens=32, block_size=4, num_blocks=48,
              preemption_mode="recompute")
    generation = [list(p) for p in prompts[:4]]
    alone = [o.outputs[0].token_ids for o in llm.generate(generation, SamplingParams(max_tokens=40, temperature=0,
                                                                                      ignore_eos=True),
                                                          use_tqdm=False)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4
    for i, prompt in enumerate(prompts):  # embeddings and generation in the same steps
        llm.engine.add_request(f"e{i}", prompt, PoolingParams(pooling))
    for i, prompt in enumerate(generation):
        llm.engine.add_request(f"g{i}", prompt, params[i])
    done, tokens = {}, {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, []) + out.outputs[0].token_ids
            if out.finished:
                done[out.request_id] = out
    got = torch.tensor([done[f"e{i}"].embedding for i in range(len(prompts))])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert [tokens[f"g{i}"] for i in range(4)] == alone and not any(tokens[f"e{i}"] for i in range(len(prompts)))
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute > 0 and stats.num_generation_tokens == 4 * 40 * 2
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    again = llm.embed(prompts, PoolingParams(pooling), use_tqdm=False)  # the prompts' blocks cached now
    assert torch.allclose(torch.tensor([o.embedding for o in again]), expected, atol=1e-5)
    assert (min(o.num_cached_tokens for o in again) > 0) == (pooling == "last")


def test_dimensions_keep_the_first_ones_normalised_and_bad_ones_are_refused(tiny_llama):
    llm = LLM(tiny_llama, quantization="none")
    prompt = list(range(5, 30))
    [out] = llm.embed([prompt], PoolingParams("mean", dimensions=8), use_tqdm=False)
    assert torch.allclose(torch.tensor(out.embedding), _reference(tiny_llama, [prompt], "mean", 8)[0], atol=1e-5)
    with pytest.raises(InvalidRequestError, match="hidden size 64") as raised:
        llm.embed([prompt], PoolingParams(dimensions=65), use_tqdm=False)
    assert raised.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as raised:
        PoolingParams("max")
    assert raised.value.param == "pooling"
    assert not llm.engine.has_unfinished_requests()


def test_a_burst_of_embeddings_takes_only_its_share_of_the_steps_and_never_holds_up_generation(tiny_llama,
                                                                                              monkeypatch):
    """While requests decode, each step's embedding tokens stay within the budget their earned
    step time pays for (some steps take none), and a generation request that arrives behind the
    whole burst is admitted at once; with nothing decoding, embeddings take the step's whole
    budget. Steps are priced by a fixed line (2 ms + 0.02 ms a token), not this machine's clock, so
    a busy machine changes nothing; the rest is the real path."""
    llm = LLM(tiny_llama, quantization="none", max_num_batched_tokens=256)
    engine = llm.engine
    scheduler = engine.scheduler
    observe, schedule, steps = scheduler.observe_step, scheduler.schedule, []

    def priced(num_tokens, seconds, *args):
        observe(num_tokens, 2e-3 + 2e-5 * num_tokens, *args)

    def recorded():  # each step's embedding budget and the embedding tokens it scheduled
        out = schedule()
        took = sum(s.num_input_tokens for s in out.scheduled if s.request.pooling is not None)
        steps.append((scheduler._embedding_budget + took if scheduler._embedding_budget is not None else None, took))
        return out

    monkeypatch.setattr(scheduler, "observe_step", priced)
    monkeypatch.setattr(scheduler, "schedule", recorded)
    for i in range(4):
        engine.add_request(f"g{i}", list(range(5, 21)), SamplingParams(max_tokens=480, temperature=0, ignore_eos=True))
    for _ in range(30):  # all decoding; the step-time model has figures
        engine.step()
    embeddings = [_add_embedding(engine, f"e{i}", list(range(100 + i, 164 + i))) for i in range(40)]  # none cached
    engine.add_request("late", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0))
    del steps[:]
    steps_to_late = None
    for step in range(1, 2000):
        events = engine.step()
        if steps_to_late is None and any(e.request_id == "late" for e in events):
            steps_to_late = step
        if all(r.embedding is not None for r in embeddings):
            break
    assert steps_to_late == 1  # its prompt and first token in the first step after it arrived
    assert all(budget is not None and took <= budget < 252 for budget, took in steps)
    assert any(took == 0 for _, took in steps) and sum(took for _, took in steps) == 40 * 64
    for i in range(4):
        engine.abort_request(f"g{i}")
    [alone] = [_add_embedding(engine, "alone", list(range(5, 205)))]
    del steps[:]
    engine.step()
    assert [budget for budget, _ in steps] == [None] and alone.embedding is not None  # one step, the whole budget


def _add_embedding(engine, request_id: str, prompt: list[int]):
    """Adds an embedding request; its scheduler Request (to read its progress)."""
    engine.add_request(request_id, prompt, PoolingParams())
    return engine.scheduler.requests[request_id]
