"""Request: the unit the scheduler schedules. A request forked for n > 1 yields sibling requests
(the samples of one user request) that share its prompt's KV blocks copy-on-write; a beam of a
beam search yields the beams that extend it, sharing its blocks the same way.

Owns token lists, `num_computed_tokens`, status and timings; does not own block ids or queues.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.outputs import SpecCounts
from engine.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.lora import Adapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PARKED = "parked"  # a beam that sampled, holding its blocks until its search picks what extends it
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the request failed; its stream ends with the error, not a finish reason


class OutputConstraint(Protocol):
    """What a structured output's tokens must match (engine.grammar.RequestGrammar)."""

    def accept(self, token_id: int) -> None: ...  # raises if the token breaks the constraint

    def fresh(self) -> OutputConstraint: ...  # the same constraint from its start

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None: ...  # the tokens allowed next

    @property
    def is_finished(self) -> bool: ...


class Request:
    # Invariants:
    #   token_ids == prompt_token_ids + output_token_ids
    #   0 <= num_computed_tokens <= num_tokens; tokens [num_computed_tokens, num_tokens) still need a
    #   forward pass (the whole prompt when new, the last sampled token when decoding).
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group_id: str | None = None, sample_index: int = 0, priority: int = 0,
                 arrival_time: float | None = None, constraint: OutputConstraint | None = None,
                 beam: bool = False, pooling: PoolingParams | None = None, adapter: Adapter | None = None):
        """`beam`: a beam of a beam search (engine.beam_groups): parked after its one sampled
        token, which its search replaces by the tokens it extends the beam with. `pooling`: an
        embedding request (its pooling resolved): its prompt is computed, never sampled from, and
        it ends with `embedding` set. `adapter`: the LoRA adapter it runs with (an engine.lora.Adapter,
        installed)."""
        self.request_id = request_id
        self.group_id = group_id or request_id  # the user request this sample belongs to
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)  # never changed: num_prompt_tokens is kept
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.constraint = constraint  # advanced by every appended token
        self.beam = beam
        self.pooling = pooling
        self.adapter = adapter
        self.embedding: list[float] | None = None
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.ended_on_stop_token = False  # its last token is an EOS or stop token: not part of its text
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache (last admission)
        self.num_preemptions = 0
        self.spec = SpecCounts()  # its drafts verified and accepted
        # per prompt token so far (None for the first), when asked: prompt tokens are computed
        # (not served by the prefix cache) until each has its logprobs
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if params.prompt_logprobs is not None \
            else None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens in hand whose KV is not computed yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """One token uncomputed (num_uncomputed_tokens, inlined: every request asks every step), and
        not an embedding request, whose prompt's last token is prompt like the rest (its budget's)."""
        return len(self.token_ids) - self.num_computed_tokens == 1 and self.pooling is None

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens the prefix cache may serve: not the last (its logits are needed), nor
        a prompt token whose next token's logprobs are still to be computed, nor any of a prompt
        whose hidden states are all pooled."""
        if self.pooling is not None and self.pooling.pooling == "mean":
            return 0
        unscored = self.first_unscored_position
        return self.num_tokens - 1 if unscored is None else min(self.num_tokens - 1, unscored)

    @property
    def first_unscored_position(self) -> int | None:
        """The first prompt position whose logits give prompt logprobs still missing; None if
        none are asked for or missing."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens:
            return None
        return len(self.prompt_logprobs) - 1

    def record_prompt_logprobs(self, start: int, entries: list[dict[int, float]]) -> None:
        """The logprobs of the prompt tokens after positions start, start + 1, ... (those already
        known, recomputed after a preemption, are kept)."""
        if self.prompt_logprobs is None:
            raise ValueError("prompt logprobs recorded for a request that asked for none")
        for i, entry in enumerate(entries):
            if start + 1 + i == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.constraint is not None:
            self.constraint.accept(token_id)
        self.token_ids.append(token_id)

    def fork(self, sample_index: int) -> Request:
        """A sibling sample sharing this request's prompt; it recomputes the last prompt token
        (so it draws its own first token) into the blocks it shares copy-on-write."""
        child = Request(f"{self.group_id}#{sample_index}", self.prompt_token_ids, self.params,
                        group_id=self.group_id, sample_index=sample_index, priority=self.priority,
                        arrival_time=self.arrival_time,
                        constraint=self.constraint.fresh() if self.constraint is not None else None,
                        adapter=self.adapter)
        child.num_computed_tokens = self.num_prompt_tokens - 1
        child.prompt_logprobs = None  # the prompt's are reported once, by the first sample
        child.first_scheduled_time = self.first_scheduled_time
        return child

    def beam_child(self, request_id: str, token_id: int) -> Request:
        """The beam extending this parked beam by `token_id` in place of the token it sampled:
        the same computed tokens, so it can share this beam's blocks (the caller gives them)."""
        child = Request(request_id, self.token_ids[:-1] + [token_id], self.params, group_id=self.group_id,
                        priority=self.priority, arrival_time=self.arrival_time, beam=True, adapter=self.adapter)
        child.num_computed_tokens = self.num_computed_tokens
        child.first_scheduled_time = self.first_scheduled_time
        return child
