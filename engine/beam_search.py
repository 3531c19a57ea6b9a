"""Beam search, as transformers' `generate(num_beams=..., do_sample=False)` runs it: the same
candidates, finished hypotheses, length penalty and stopping rule (its default
`early_stopping=False` heuristic), so the same sequences.

A step takes the top-K next-token logprobs of every running beam (transformers' K:
max(2, 1 + the number of EOS ids) x beam_width) and picks the next beams, each one token longer
than the beam it extends. The search (`BeamSearch`) is plain Python on those logprobs; the engine
runs it inside its step loop (engine.beam_groups), where each beam is a request that shares the
blocks of the beam it extends, and `LLM.beam_search` and `EngineClient.beam_search` hand it there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams, at most `max_tokens` each, scores divided
    by length ** `length_penalty` when ranked; `ignore_eos`: only the length ends a beam."""
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise InvalidRequestError(name, f"{name} must be an int >= 1, got {value!r:.40}")
        if not (isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
                and -10 <= self.length_penalty <= 10):
            raise InvalidRequestError("length_penalty", f"length_penalty must be a number in [-10, 10], got "
                                                        f"{self.length_penalty!r:.40}")


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...] = ()
    score: np.float32 = np.float32(0.0)  # the sum of its tokens' logprobs


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam; `score` is its logprob sum over length ** length_penalty."""
    beam: Beam
    score: np.float32


class BeamSearch:
    """One prompt's search. Each step: `running` beams -> `advance(each one's top-K logprobs)`,
    until `done`; then `output()`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = candidates_per_step(params.beam_width, self.eos_token_ids)
        self.max_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.running = [Beam()]
        self.parents: list[int] = [0]  # per running beam: the index of the beam it extends among the last ones
        self.finished: list[Hypothesis] = []  # the best beam_width, best first
        self._improvable = True
        self.done = False
        self.metrics = RequestMetrics(time.time())

    def step_params(self) -> SamplingParams:
        """What each running beam asks the engine for: its next token's top-K logprobs."""
        return SamplingParams(max_tokens=1, temperature=0, logprobs=self.num_candidates, ignore_eos=True)

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """`top_logprobs[i]`: at least the top-K next tokens of running beam i -> their logprobs."""
        width, length = self.params.beam_width, len(self.running[0].token_ids) + 1  # the candidates' length
        candidates = sorted(((beam.score + np.float32(lp), b, token)
                             for b, beam in enumerate(self.running) for token, lp in top_logprobs[b].items()),
                            key=lambda c: (-c[0], c[1], c[2]))[:self.num_candidates]
        ends = [token in self.eos_token_ids or length >= self.max_tokens for _, _, token in candidates]
        new_hypotheses = [Hypothesis(self._extend(b, token, score), np.float32(score / self._norm(length)))
                          for rank, ((score, b, token), end) in enumerate(zip(candidates, ends))
                          if end and rank < width and self._improvable]
        self.finished = sorted(self.finished + new_hypotheses, key=lambda h: -h.score)[:width]
        kept = [(b, token, score) for (score, b, token), end in zip(candidates, ends) if not end][:width]
        self.running = [self._extend(b, token, score) for b, token, score in kept]
        self.parents = [b for b, _, _ in kept]
        if len(self.finished) == width and self.running:  # can a running beam still beat the worst finished?
            best_possible = self.running[0].score / self._norm(length)
            self._improvable = bool(best_possible > self.finished[-1].score)
        self.done = not self._improvable or not self.running
        now = time.time()
        self.metrics.first_token_time = self.metrics.first_token_time or now
        self.metrics.finished_time = now if self.done else None

    def _extend(self, b: int, token: int, score: np.float32) -> Beam:
        return Beam(self.running[b].token_ids + (token,), score)

    def _norm(self, length: int) -> float:
        return float(length) ** self.params.length_penalty

    def output(self, request_id: str, tokenizer) -> RequestOutput:
        """The finished beams, best first, as one RequestOutput with an output per beam."""
        outputs: list[CompletionOutput] = []
        for i, h in enumerate(self.finished):
            stopped = h.beam.token_ids[-1] in self.eos_token_ids
            text_ids = h.beam.token_ids[:-1] if stopped else h.beam.token_ids
            outputs.append(BeamOutput(i, tokenizer.decode(text_ids, skip_special_tokens=True), list(h.beam.token_ids),
                                      "stop" if stopped else "length", cumulative_logprob=float(h.beam.score),
                                      score=float(h.score)))
        return RequestOutput(request_id, None, self.prompt_token_ids, outputs, True, self.metrics)


@dataclass(slots=True)
class BeamOutput(CompletionOutput):
    cumulative_logprob: float = 0.0  # the sum of its tokens' logprobs
    score: float = 0.0  # what ranked it: cumulative_logprob / length ** length_penalty


def candidates_per_step(beam_width: int, eos_token_ids: frozenset[int]) -> int:
    """Transformers' K: enough candidates that `beam_width` survive even if every EOS is among
    them; the engine returns at most MAX_LOGPROBS per token, which bounds beam_width."""
    k = max(2, 1 + len(eos_token_ids)) * beam_width
    if k > MAX_LOGPROBS:
        raise InvalidRequestError("beam_width", f"beam_width must be at most "
                                                f"{MAX_LOGPROBS // max(2, 1 + len(eos_token_ids))} for this model, "
                                                f"got {beam_width}")
    return k
