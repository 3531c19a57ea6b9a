"""What the engine hands back: the runner's per-step result, per-request outputs (deltas or
cumulative), timings, and request failures. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, list[int]]  # request id -> its new tokens (accepted drafts, then one sampled)
    logprobs: dict[str, list[dict[int, float]]]  # request id -> logprobs of each new token, when asked
    errors: dict[str, Exception] = field(default_factory=dict)  # request id -> why sampling it failed
    draft_passes: int = 0  # draft-model passes that filled the drafts
    draft_seconds: float = 0.0  # the time they took (with the call to a remote draft model, and the catch-up)
    drafts_unfilled: bool = False  # drafts were reserved and the draft model gave none (late, down, no room)
    draft_catch_up_tokens: int = 0  # tokens the draft model computed first, for requests it did not hold
    # request id -> (the first position scored, the logprobs of the prompt tokens after each position)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embedding request id -> its embedding, when done


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    logprobs: list[dict[int, float]] | None = None  # per token: sampled + top tokens
    stop_string: str | None = None  # the stop string that ended it, if one did


@dataclass(slots=True)
class SpecCounts:
    """Speculative decoding's tallies, for one request or the whole engine."""
    verifications: int = 0  # request-steps that verified drafts
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which the target agreed with

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.verifications += 1
        self.proposed += num_proposed
        self.accepted += num_accepted

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.verifications + other.verifications, self.proposed + other.proposed,
                          self.accepted + other.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification."""
        return self.accepted / self.verifications if self.verifications else 0.0


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # wall-clock seconds (time.time())
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    spec: SpecCounts = field(default_factory=SpecCounts)  # over all its samples

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        """Mean gap between output tokens after the first."""
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # (a step loop's outputs after the first carry none: [] here, None in `prompt`)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (None for the first), once
    embedding: list[float] | None = None  # an embedding request's, with its one output

    def merge(self, delta: RequestOutput) -> None:
        """Folds a delta of the same request into this cumulative output."""
        by_index = {o.index: o for o in self.outputs}
        merge_deltas(by_index, delta.outputs)
        self.outputs = sorted(by_index.values(), key=lambda o: o.index)
        self.finished = delta.finished
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.embedding = self.embedding or delta.embedding


def merge_deltas(by_index: dict[int, CompletionOutput], deltas: list[CompletionOutput], offset: int = 0) -> None:
    """The one way deltas accumulate: each delta's text, tokens and logprobs are appended to the
    output at `offset + delta.index` (created empty when new), and its finish reason (and stop
    string) kept."""
    for d in deltas:
        mine = by_index.get(offset + d.index)
        if mine is None:
            mine = by_index[offset + d.index] = CompletionOutput(offset + d.index, "", [])
        mine.text += d.text
        mine.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            mine.logprobs = (mine.logprobs or []) + d.logprobs
        if d.finish_reason is not None:
            mine.finish_reason, mine.stop_string = d.finish_reason, d.stop_string


@dataclass(slots=True)
class RequestError:
    """A request that failed (refused at add, or failed while running): its stream raises
    `error`; nothing else of it follows."""
    request_id: str
    error: Exception
