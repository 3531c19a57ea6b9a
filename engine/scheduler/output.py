"""What crosses from the scheduler to the runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.drafts import SampledDraft
from engine.request import Request

PENDING_TOKEN = -1  # an input token the step before samples, read on the device (async scheduling)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request  # read-only for the runner: params, token history, RNG for sampling
    token_ids: list[int]  # input tokens fed this step (a speculating decode: its last token + drafts)
    # (drafts from a model in the runner are reserved by the scheduler and filled in by the runner)
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    # per KV group, device blocks covering positions [0, start_pos + len(token_ids)) (engine/kv_cache/layout.py;
    # a sliding group's blocks before its window NULL_BLOCK)
    block_tables: list[list[int]]
    sample: bool  # True when this chunk reaches the request's last token: sample its next one
    draft_token_ids: list[int] = field(default_factory=list)  # the tail of token_ids to verify
    sampled_drafts: list[SampledDraft] | None = None  # their distributions, if drawn at random (else one-hot)

    @property
    def num_input_tokens(self) -> int:
        """Tokens of the request itself (not drafts) this step computes."""
        return len(self.token_ids) - len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefill chunks
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), run first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), run second
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst), third
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: drop their state

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: len(s.token_ids) for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
