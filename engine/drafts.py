"""What crosses between speculation's sides: the scheduler's drafts to the runner, and the
runner's calls to a draft worker (engine/runner/speculation/draft_model.py), in-process or
through a DraftTransport the host hands the engine (placement `actor`: the serve app's DraftModel
deployment). Torch-free, so the serve app imports it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledDraft:
    """A draft token drawn from a distribution q over `support` (probabilities `probs`): what
    verification needs to accept it with probability min(1, p/q)."""
    token_id: int
    support: list[int]
    probs: list[float]


@dataclass(frozen=True, slots=True)
class DraftQuery:
    request_id: str
    num_kept: int  # the request's first tokens the worker was sent before (it keeps those)
    new_token_ids: list[int]  # the request's tokens after them
    num_drafts: int
    params: SamplingParams | None = None  # sample drafts under these; None: argmax (one-hot) drafts


@dataclass(frozen=True, slots=True)
class DraftCall:
    """One engine step's queries, and the requests that ended since the last call delivered."""
    queries: list[DraftQuery]
    finished_ids: list[str]


@dataclass(frozen=True, slots=True)
class DraftReply:
    drafts: list[list[int] | None]  # per query; None: the worker lacks its first num_kept tokens
    sampled: list[list[SampledDraft] | None]  # per query with params: its drafts' distributions


class DraftTransport(Protocol):
    """Carries one step's call to a draft worker the engine does not hold; None when no reply
    came in time (the step decodes without drafts)."""

    def __call__(self, call: DraftCall) -> DraftReply | None: ...


# Builds the transport where the engine runs: the factory crosses to an engine process of its own
# (pickled with the config), the connection it opens does not.
DraftTransportFactory = Callable[[], DraftTransport]
