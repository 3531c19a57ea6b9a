"""What crosses between an engine and its draft worker, in-process or to the DraftModel
deployment (engine.spec_decode.draft_model). Torch-free, so the serve app imports it."""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams

DRAFT_DEPLOYMENT = "DraftModel"  # the Serve deployment engines call with placement `actor`


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
