"""Sampler transforms on hand-built logits."""
from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


def _request(prompt=(1, 2), output=(), **params) -> Request:
    request = Request("r", list(prompt), SamplingParams(**params))
    for t in output:
        request.append_token(t)
    return request


def test_greedy_takes_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    out = Sampler(0)(logits, [_request(temperature=0), _request(temperature=0)])
    assert out.token_ids == [1, 0]


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    assert Sampler(0)(logits.clone(), [_request(prompt=(0,), temperature=0)]).token_ids == [0]
    assert Sampler(0)(logits.clone(), [_request(prompt=(0,), temperature=0, repetition_penalty=1.2)]).token_ids == [1]


def test_presence_and_frequency_penalties_use_output_only():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    # token 0 in the prompt only: untouched
    assert Sampler(0)(logits.clone(), [_request(prompt=(0,), temperature=0, presence_penalty=1.0)]).token_ids == [0]
    assert Sampler(0)(logits.clone(), [_request(prompt=(2,), output=(0,), temperature=0,
                                                presence_penalty=1.0)]).token_ids == [1]
    assert Sampler(0)(logits.clone(), [_request(output=(0,), temperature=0, frequency_penalty=0.6)]).token_ids == [1]


def test_top_p_and_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0)
    seen_top_p = {sampler(logits, [_request(temperature=1.0, top_p=0.7)]).token_ids[0] for _ in range(200)}
    assert seen_top_p == {0, 1}
    seen_min_p = {sampler(logits, [_request(temperature=1.0, min_p=0.5)]).token_ids[0] for _ in range(200)}
    assert seen_min_p == {0, 1}
    seen_top_k = {sampler(logits, [_request(temperature=1.0, top_k=3)]).token_ids[0] for _ in range(300)}
    assert seen_top_k == {0, 1, 2}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(0)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sampler(probs.log()[None], [_request(temperature=1.0)]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)
