"""The draft-model worker and its engine-side drafter: drafts are the draft model's greedy
continuation of each request's tokens after every rollback, eviction and restart of the worker;
the engine's output is the target's whatever the draft (the target itself: every draft accepted;
an unrelated random model: most rejected; a worker that misses calls: plain steps, counted); a
worker behind the transport an actor placement is handed drafts the same way; a draft with
another vocabulary, or an actor placement with no draft model or no transport, is refused."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, LLMEngine, SamplingParams
from engine.config import ModelConfig, SpeculativeConfig
from engine.drafts import DraftCall, DraftQuery
from engine.models.linear import BlockQuantLinear
from engine.runner.speculation.draft_model import load_draft_worker
from tests.conftest import save_tiny_model
from tests.engine.helpers import hf_greedy, repetitive_prompts, save_first_layer

BLOCK = 4  # small blocks: rollbacks cross block boundaries


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory) -> str:
    return save_first_layer(tiny_llama, tmp_path_factory.mktemp("draft"))


def _worker(tiny_llama, draft_dir, num_blocks: int = 64):
    spec = SpeculativeConfig(method="draft_model", model=draft_dir)
    block_bytes = 2 * 1 * BLOCK * 2 * 16 * 4  # one layer, two KV heads of 16, float32
    return load_draft_worker(spec, ModelConfig(model=tiny_llama), None, BLOCK, num_blocks * block_bytes)


def _greedy(model, tokens: list[int], k: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                             attention_mask=torch.ones(1, len(tokens), dtype=torch.long), pad_token_id=0)
    return out[0, len(tokens):].tolist()


def test_drafts_continue_each_request_after_rollbacks_evictions_and_a_restart(tiny_llama, draft_dir):
    reference = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    worker = _worker(tiny_llama, draft_dir, num_blocks=12)
    assert worker.kv.num_blocks == 12
    a, b = [5, 9, 13, 17, 21, 25, 29], [40, 41, 42, 43, 44]
    reply = worker.propose(DraftCall([DraftQuery("a", 0, a, 3), DraftQuery("b", 0, b, 2)], []))
    assert reply.drafts == [_greedy(reference, a, 3), _greedy(reference, b, 2)]
    d = reply.drafts[0]
    # the target accepted d[0], rejected d[1] and sampled 77 instead: the worker rolls back to a + d[0]
    a += [d[0], 77]
    reply = worker.propose(DraftCall([DraftQuery("a", 7, a[7:], 4)], []))
    assert reply.drafts == [_greedy(reference, a, 4)]
    # every draft accepted, plus a bonus token
    a += reply.drafts[0] + [3]
    assert worker.propose(DraftCall([DraftQuery("a", 9, a[9:], 2)], [])).drafts == [_greedy(reference, a, 2)]

    # a long new sequence needs more blocks than are free: the least recently used one (b) goes
    c = list(range(100, 130))
    assert worker.propose(DraftCall([DraftQuery("c", 0, c, 2)], [])).drafts == [_greedy(reference, c, 2)]
    assert worker.propose(DraftCall([DraftQuery("b", 5, [8], 2)], [])).drafts == [None]  # b was evicted
    assert worker.propose(DraftCall([DraftQuery("b", 0, b + [8], 2)], [])).drafts == [_greedy(reference, b + [8], 2)]

    worker.propose(DraftCall([], ["a", "b", "c"]))  # the requests ended
    assert worker.num_sequences == 0
    worker.kv.check_integrity()
    assert worker.kv.num_free_blocks == worker.kv.num_blocks

    restarted = _worker(tiny_llama, draft_dir)  # a new worker knows nothing of a request it was sent before
    assert restarted.propose(DraftCall([DraftQuery("a", 9, a[9:], 2)], [])).drafts == [None]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts = repetitive_prompts(8, seed=3)
    return tiny_llama, prompts, hf_greedy(tiny_llama, prompts, 24)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _step_through(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of `prompts`, stepping the engine by hand and checking the block accounting
    after every step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0))
    outputs = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.outputs[0].token_ids)
        engine.kv.check_integrity()
    return [outputs[str(i)] for i in range(len(prompts))]


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(reference):
    model_dir, prompts, expected = reference
    llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": model_dir, "adaptive": False},
              max_num_seqs=64)
    assert _generate(llm, prompts) == expected
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0.6 * len(prompts) * 24
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens


def test_the_target_quantized_as_its_own_draft_gives_the_fp32_targets_output(reference):
    """An fp32 target drafted by its own int8 blocks: the target's exact output, the draft's
    matmuls block-quantized (its decode steps through the fused stack), and most drafts accepted
    (int8 agrees with fp32 on ~93% of this random model's tokens)."""
    model_dir, prompts, expected = reference
    llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": model_dir, "quantization": "int8",
                                             "adaptive": False}, max_num_seqs=64)
    assert _generate(llm, prompts) == expected
    draft = llm.engine.runner.drafter.transport.__self__.model
    assert isinstance(draft.layers[0].qkv, BlockQuantLinear) and draft.decode_stack is not None
    assert not isinstance(llm.engine.loaded.model.layers[0].qkv, BlockQuantLinear)  # the target stays fp32
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0.6 * len(prompts) * 24
    assert stats.num_spec_accepted_tokens > 0.7 * stats.num_spec_proposed_tokens


def test_an_unrelated_draft_model_changes_no_output(reference, tmp_path):
    model_dir, prompts, expected = reference
    other = save_tiny_model(tmp_path / "other", seed=7, hidden_size=32, num_hidden_layers=1)
    llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": other, "adaptive": False},
              num_blocks=40, block_size=4, max_num_batched_tokens=24, preemption_mode="swap")
    assert _generate(llm, prompts) == expected
    stats = llm.engine.get_stats()
    assert stats.num_spec_accepted_tokens < 0.5 * stats.num_spec_proposed_tokens
    assert stats.num_preemptions_swap > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_a_draft_worker_that_misses_calls_means_plain_steps_with_the_same_output(reference, draft_dir):
    """Every other call brings no reply (a late or dead actor): those steps release their
    reserved draft slots and decode plainly; the worker is brought up to date on the next call."""
    model_dir, prompts, expected = reference
    engine = LLMEngine.from_engine_args(model_dir, speculative_config={"method": "draft_model", "model": draft_dir,
                                                                       "adaptive": False})
    drafter = engine.runner.drafter
    worker_propose, calls = drafter.transport, []

    def flaky(call: DraftCall):
        calls.append(call)
        return worker_propose(call) if len(calls) % 2 else None

    drafter.transport = flaky
    assert _step_through(engine, prompts) == expected
    stats = engine.get_stats()
    assert len(calls) > 4 and 0 < stats.num_spec_accepted_tokens
    assert stats.num_spec_unfilled_steps == len(calls) // 2  # the calls without a reply, counted
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_an_actor_placement_drafts_through_the_transport_the_host_hands_the_engine(reference, draft_dir):
    """placement `actor`: each step's call goes through the transport the factory builds (here a
    worker in this process, standing in for the serve app's DraftModel deployment)."""
    model_dir, prompts, expected = reference
    spec = {"method": "draft_model", "model": draft_dir, "adaptive": False}
    worker = LLMEngine.from_engine_args(model_dir, speculative_config=spec).runner.drafter.transport
    calls = []

    def transport(call: DraftCall):
        calls.append(call)
        return worker(call)

    llm = LLM(model_dir, speculative_config={**spec, "placement": "actor"}, draft_transport=lambda: transport)
    assert _generate(llm, prompts) == expected
    stats = llm.engine.get_stats()
    assert len(calls) > 4 and stats.num_spec_unfilled_steps == 0 and stats.num_spec_accepted_tokens > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_a_draft_pass_is_priced_without_the_prompts_the_draft_catches_up_on(reference, draft_dir):
    """The call that brings the worker new requests also computes their tokens so far: it reports
    them, its time beyond its passes prices a catch-up token, and it prices no pass (a one-time
    cost, which would price passes far above what they cost for the rest of a request); the pass
    price comes from the other calls."""
    model_dir, prompts, expected = reference
    engine = LLMEngine.from_engine_args(model_dir, speculative_config={"method": "draft_model", "model": draft_dir,
                                                                       "adaptive": False})
    scheduler, observed = engine.scheduler, []
    observe_step = scheduler.observe_step

    def recording(num_tokens, seconds, num_draft_passes=0, draft_seconds=0.0, num_drafting=0, num_catch_up_tokens=0):
        observed.append((num_draft_passes, draft_seconds, num_drafting, num_catch_up_tokens))
        observe_step(num_tokens, seconds, num_draft_passes, draft_seconds, num_drafting, num_catch_up_tokens)

    scheduler.observe_step = recording
    assert _step_through(engine, prompts) == expected
    drafted = [call for call in observed if call[1] > 0]
    caught_up = sum(call[3] for call in drafted)
    # every request's tokens up to its first drafts: its prompt and the token its prefill sampled
    assert drafted[0][3] > 0 and caught_up == sum(len(prompt) + 1 for prompt in prompts)
    assert scheduler.catch_up_seconds_per_token > 0
    per_pass: dict[int, list[float]] = {}  # by the requests a pass drafted for
    for passes, seconds, requests, catch_up in drafted:
        if not catch_up:
            per_pass.setdefault(requests, []).append(seconds / passes)
    assert sum(map(len, per_pass.values())) > 5
    for requests, times in per_pass.items():
        assert min(times) <= scheduler.draft_pass_seconds(requests) <= max(times)


def test_a_draft_of_another_vocabulary_or_with_no_draft_model_is_refused(tiny_llama, tiny_llama_words):
    with pytest.raises(ValueError, match="different vocabulary"):
        LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama_words})
    with pytest.raises(ValueError, match="required with method 'draft_model'"):
        LLM(tiny_llama, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="sets a draft_model's mode"):  # self_draft runs the target's own
        SpeculativeConfig(method="self_draft", quantization="int8")
    with pytest.raises(ValueError, match="sets a draft_model's mode"):  # auto would score the draft at start-up
        SpeculativeConfig(method="draft_model", model=tiny_llama, quantization="auto")
    with pytest.raises(ValueError, match="placement 'actor' runs a draft model"):
        SpeculativeConfig(method="ngram", placement="actor")
    with pytest.raises(ValueError, match="needs a draft transport"):  # the serve app hands one to its engines
        LLM(tiny_llama, speculative_config={"method": "self_draft", "placement": "actor"})
