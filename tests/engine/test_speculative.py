"""Speculative decoding with n-gram, self-draft and draft-model drafts: lossless under every
scheduling feature.

Greedy output equals transformers' token for token with drafts verified inside the continuous
batch (chunked prefill, preemption by swap and by recompute, prefix caching, priorities, n > 1,
aborts, adaptive k), the drafts were really proposed, accepted and rejected, and no KV block
leaks. A self-draft with every layer is the target itself: every draft is accepted. Sampled
output keeps the target's distribution (chi-square against the exact distribution computed by
transformers).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from engine import LLM, LLMEngine, SamplingParams
from engine.drafts import SampledDraft
from engine.outputs import SpecCounts
from engine.request import Request
from engine.runner.speculation.verify import accepted_tokens
from engine.sampler import Sampler, sampling_probs
from engine.scheduler.speculation.ngram import NgramProposer
from tests.engine.helpers import hf_greedy, repetitive_prompts, save_first_layer

MAX_NEW = 32
# every draft verified (not adaptive): drafts are proposed, accepted and rejected whatever the step cost
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
SELF_DRAFT = {"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 3, "adaptive": False}  # 1 of 2 layers
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}  # + the draft's path
METHODS = pytest.mark.parametrize("method", ["ngram", "self_draft", "draft_model"])


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama, tmp_path_factory) -> str:
    return save_first_layer(tiny_llama, tmp_path_factory.mktemp("tiny-draft"))


@pytest.fixture
def spec(method, tiny_draft) -> dict:
    return {"ngram": NGRAM, "self_draft": SELF_DRAFT, "draft_model": {**DRAFT_MODEL, "model": tiny_draft}}[method]


def _propose(proposer: NgramProposer, token_ids: list[int], k: int) -> list[int]:
    return proposer.propose([Request(f"q{len(token_ids)}-{k}", token_ids, SamplingParams())], [k])[0]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    assert _propose(proposer, [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest occurrence of [1, 2, 3]
    assert _propose(proposer, [5, 1, 2, 6, 6, 2], 3) == [6, 6, 2]  # only the 1-gram [2] occurs earlier
    assert _propose(proposer, [4, 4, 4], 5) == [4]  # a match may overlap the suffix
    assert _propose(proposer, [1, 2, 3, 4], 3) == []  # nothing repeats
    assert _propose(NgramProposer(2, 3), [5, 1, 2, 6, 6, 2], 3) == []  # the 2-gram [6, 2] never occurred


def _scan(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: the latest earlier occurrence of the longest suffix."""
    last = len(token_ids) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        for end in range(last - 1, n - 2, -1):
            if token_ids[end - n + 1:end + 1] == token_ids[last - n + 1:]:
                return token_ids[end + 1:end + 1 + k]
    return []


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       appends=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=20),
       min_n=st.integers(1, 3), extra=st.integers(0, 2), k=st.integers(1, 5))
def test_ngram_index_extended_step_by_step_agrees_with_a_full_scan(prompt, appends, min_n, extra, k):
    """Tokens arrive a few at a time (accepted drafts and the bonus token); each step's draft from
    the incremental index equals the brute-force scan of the whole sequence."""
    proposer = NgramProposer(min_n, min_n + extra)
    request = Request("r", prompt, SamplingParams())
    for new in [[]] + appends:
        request.token_ids.extend(new)
        assert proposer.propose([request], [k]) == [_scan(request.token_ids, k, min_n, min_n + extra)]
    proposer.forget("r")
    assert proposer.propose([request], [k]) == [_scan(request.token_ids, k, min_n, min_n + extra)]


def test_accepted_tokens_stop_at_the_first_disagreement_and_keep_the_bonus():
    assert accepted_tokens([7, 8, 9], [7, 8]) == [7, 8, 9]  # all drafts accepted, plus the bonus token
    assert accepted_tokens([7, 5, 9], [7, 8]) == [7, 5]  # second draft rejected: the target's token instead
    assert accepted_tokens([6, 8, 9], [7, 8]) == [6]
    assert accepted_tokens([4], []) == [4]


def _time_steps_as_a_cpu_at_small_batches(scheduler, monkeypatch) -> None:
    """The scheduler learns step times of a CPU decoding a small batch (50 ms fixed, the weights
    read once, and 0.1 ms a token; a draft pass 5 ms and 0.1 ms a request; a catch-up 0.1 ms a
    token) in place of this machine's: on a loaded test machine a tiny model's measured steps are
    mostly noise, and the drafts the planner takes followed it (in one run, none)."""
    observe = scheduler.observe_step

    def observe_modelled(num_tokens, seconds, num_draft_passes=0, draft_seconds=0.0, num_drafting=0,
                         num_catch_up_tokens=0):
        draft_seconds = num_draft_passes * (0.005 + 1e-4 * num_drafting) + 1e-4 * num_catch_up_tokens
        observe(num_tokens, 0.050 + 1e-4 * num_tokens, num_draft_passes, draft_seconds, num_drafting,
                num_catch_up_tokens)

    monkeypatch.setattr(scheduler, "observe_step", observe_modelled)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts = repetitive_prompts(8)
    return tiny_llama, prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=64),
    dict(max_num_seqs=1),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # drafts compete with prefill chunks for the budget
    dict(max_num_seqs=64, enable_prefix_caching=False),
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=24, preemption_mode="swap"),
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=24, preemption_mode="recompute"),
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=24, preemption_mode="auto", policy="priority"),
    dict(max_num_seqs=64, attention_backend="torch"),  # verify rows in pure-torch decode buckets (auto: C++ kernel)
    dict(max_num_seqs=64, adaptive=True),  # k chosen per request and step
], ids=["batch64", "batch1", "chunked16", "no-prefix-cache", "preempt-swap", "preempt-recompute",
        "preempt-auto-priority", "torch-attention", "adaptive"])
@METHODS
def test_greedy_with_drafts_matches_transformers(reference, engine_args, spec, monkeypatch):
    model_dir, prompts, expected = reference
    engine_args = dict(engine_args)
    spec = {**spec, "adaptive": engine_args.pop("adaptive", False)}
    llm = LLM(model_dir, speculative_config=spec, **engine_args)
    if spec["adaptive"]:
        _time_steps_as_a_cpu_at_small_batches(llm.engine.scheduler, monkeypatch)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens  # drafts accepted and rejected
    per_request = sum((o.metrics.spec for o in outputs), SpecCounts())  # each request's own tallies add up
    assert (per_request.proposed, per_request.accepted) == (stats.num_spec_proposed_tokens,
                                                            stats.num_spec_accepted_tokens)
    assert per_request.mean_accepted_length == pytest.approx(stats.spec_mean_accepted_length)
    assert stats.num_generation_tokens == len(prompts) * MAX_NEW
    if "preemption_mode" in engine_args:
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


EXTRACTION = [[{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n"
                 "Continuous batching keeps the accelerator busy by adding new requests to the running batch "
                 "at every step, while a paged key-value cache lets many requests share memory without "
                 "fragmentation."}]]


@pytest.mark.slow
def test_on_the_embedded_model_extraction_takes_far_fewer_steps_with_the_same_tokens():
    """A single stream asked to repeat a sentence: n-gram drafts copy it from the prompt, so the
    answer takes far fewer steps (forward passes) than tokens, and is token for token the plain one.
    Adaptive k (the default) keeps speculating: at batch 1 drafts are nearly free and mostly accepted."""
    runs = {}
    for name, spec in (("plain", None), ("ngram", {**NGRAM, "adaptive": True})):
        llm = LLM(speculative_config=spec)
        out = llm.chat(EXTRACTION, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0].outputs[0]
        runs[name] = out.token_ids, llm.engine.get_stats()
    assert runs["ngram"][0] == runs["plain"][0] and len(runs["plain"][0]) >= 30
    plain_steps, spec_stats = runs["plain"][1].num_steps, runs["ngram"][1]
    assert spec_stats.num_steps < 0.6 * plain_steps, (spec_stats.num_steps, plain_steps)
    assert spec_stats.spec_acceptance_rate > 0.5 and spec_stats.spec_mean_accepted_length > 1.5


def test_self_draft_with_every_layer_is_the_target_itself_so_every_draft_is_accepted(reference):
    model_dir, prompts, expected = reference
    llm = LLM(model_dir, speculative_config={**SELF_DRAFT, "num_layers": 2})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0.6 * len(prompts) * MAX_NEW  # 3 drafts per step: 3 of every 4 tokens
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
    with pytest.raises(ValueError, match="num_layers must be in"):
        LLM(model_dir, speculative_config={**SELF_DRAFT, "num_layers": 3})


@METHODS
def test_stop_tokens_n_samples_logprobs_and_aborts_mid_speculation(reference, spec):
    """1. A stop token inside an accepted run of drafts ends the request there (plain decoding's
    output, tokens and logprobs alike). 2. n > 1 with a seed: every sample speculates on its own,
    output unchanged. 3. Aborting a request between steps frees its blocks."""
    model_dir, prompts, expected = reference
    stop_at = expected[0][10]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop_at], logprobs=2)
    plain = LLM(model_dir).generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    spec_llm = LLM(model_dir, speculative_config=spec)
    drafted = spec_llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    assert drafted.token_ids == plain.token_ids and drafted.finish_reason == plain.finish_reason == "stop"
    assert [sorted(lp) for lp in drafted.logprobs] == [sorted(lp) for lp in plain.logprobs]
    for a, b in zip(drafted.logprobs, plain.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)

    greedy_n = SamplingParams(max_tokens=MAX_NEW, temperature=0, n=3)
    before = spec_llm.engine.get_stats()
    output = spec_llm.generate([prompts[1]], greedy_n, use_tqdm=False)[0]
    after = spec_llm.engine.get_stats()
    assert [s.token_ids for s in output.outputs] == [expected[1]] * 3
    assert output.metrics.spec.proposed == after.num_spec_proposed_tokens - before.num_spec_proposed_tokens > 0
    assert output.metrics.spec.accepted == after.num_spec_accepted_tokens - before.num_spec_accepted_tokens

    engine = LLMEngine.from_engine_args(model_dir, speculative_config=spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    while engine.get_stats().num_spec_proposed_tokens == 0:  # until some request speculates
        assert engine.has_unfinished_requests()
        engine.step()
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `probs`; bins expected below 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat))


@pytest.mark.parametrize("q, top_k", [
    ({0: 1 / 6, 1: 1 / 6, 2: 1 / 6, 3: 1 / 6, 4: 1 / 6, 5: 1 / 6}, 0),  # a flat draft
    ({4: 0.9, 0: 0.1}, 0),  # a draft sure of a token the target finds unlikely
    ({5: 0.7, 1: 0.3}, 3),  # a draft sure of a token outside the target's top-3 (p = 0: always rejected)
], ids=["flat", "overconfident", "outside-top-k"])
def test_the_rejection_rule_draws_from_the_target_whatever_the_draft_distribution(q, top_k):
    """Drafts drawn from q, verified by the sampler: the row's token has the target's distribution p
    (chi-square over 6,000 rows) and drafts are accepted at the rate sum(min(p, q))."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, -0.5, -1.0])
    params = SamplingParams(temperature=1.0, top_k=top_k)
    p = sampling_probs(logits[None], [params])[0]
    p = p / p.sum()
    support, probs = list(q), list(q.values())
    generator = torch.Generator().manual_seed(0)
    picks = torch.multinomial(torch.tensor(probs), 6000, replacement=True, generator=generator).tolist()
    drafts = [SampledDraft(support[i], support, probs) for i in picks]
    requests = [Request(f"q{i}", [1], params) for i in range(len(drafts))]
    tokens = torch.tensor(Sampler(seed=0)(logits.repeat(len(drafts), 1), requests, drafts).token_ids)
    assert _chi_square_p_value(torch.bincount(tokens, minlength=6).float(), p) > 1e-3
    accepted = sum(int(t) == d.token_id for t, d in zip(tokens, drafts)) / len(drafts)
    q_dense = torch.zeros(6).index_put_((torch.tensor(support),), torch.tensor(probs))
    assert accepted == pytest.approx(float(torch.minimum(p, q_dense).sum()), abs=0.03)


@METHODS
def test_sampled_output_keeps_the_targets_distribution(tiny_llama_words, method, tmp_path):
    """A prompt that repeats itself, so that n-gram drafts are proposed at every step (draft models
    always propose); 3,000 samples of the first three tokens at temperature 1 with top-k 8. The
    first token's and the third token's (marginal) frequencies fit transformers' exact
    distribution (chi-square, p > 0.001), and drafts were accepted and rejected on the way."""
    spec = {"ngram": NGRAM, "self_draft": SELF_DRAFT,
            "draft_model": {**DRAFT_MODEL, "model": save_first_layer(tiny_llama_words, tmp_path)}}[method]
    spec = {**spec, "num_speculative_tokens": 2}
    words = "the cat sat on the mat the cat sat on the mat the cat sat on the"
    llm = LLM(tiny_llama_words, speculative_config=spec, seed=1)
    prompt = llm.engine.encode_prompt(words)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=8, ignore_eos=True)
    outputs = llm.generate([prompt] * 3000, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens
    tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_words, dtype=torch.float32).eval()

    def next_probs(contexts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(contexts).logits[:, -1].float()
        top = logits.topk(8, dim=-1)
        return torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, dim=-1))

    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]
    vocab = p1.shape[0]
    assert _chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab).float(), p1) > 1e-3
    # third token: sum over the first two tokens' top-8 continuations (64 contexts)
    firsts = p1.nonzero().flatten()
    p2 = next_probs(torch.cat([base.repeat(len(firsts), 1), firsts[:, None]], dim=1))
    contexts, weights = [], []
    for i, t1 in enumerate(firsts):
        for t2 in p2[i].nonzero().flatten():
            contexts.append(torch.cat([base[0], t1[None], t2[None]]))
            weights.append(p1[t1] * p2[i, t2])
    p3 = (torch.stack(weights)[:, None] * next_probs(torch.stack(contexts))).sum(0)
    assert _chi_square_p_value(torch.bincount(tokens[:, 2], minlength=vocab).float(), p3) > 1e-3
