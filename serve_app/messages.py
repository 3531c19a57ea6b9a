"""Typed objects that cross deployment boundaries (ingress <-> router <-> replica).

Owns: plain picklable dataclasses, no logic beyond tiny helpers. Errors travel as values
(`ErrorInfo`), not exceptions, so the ingress can answer them in OpenAI's shape without
unwrapping Ray exception chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ErrorInfo:
    status: int  # HTTP status the ingress should answer with
    message: str  # human-readable, names the field/numbers
    type: str = "invalid_request_error"  # OpenAI error type
    param: str | None = None  # offending request field, if any
    retry_after_s: int | None = None  # for 429/503: seconds until a retry makes sense


@dataclass(slots=True, frozen=True)
class ModelInfo:
    served_model_name: str  # the name clients pass as `model`
    max_model_len: int  # prompt + output tokens a request may use
    block_size: int  # KV block size, for prefix hashes and block estimates
    tokenizer_path: str | None  # where the ingress can load the same tokenizer from
    tokenizer: Any = None  # the engine's tokenizer itself when picklable (preferred)


@dataclass(slots=True, frozen=True)
class EngineRequest:
    request_id: str  # unique per engine request (one prompt, n choices)
    prompt: str | list[int]  # text (the engine tokenizes, as LLM.generate does) or token ids
    messages: list[dict] | None = None  # chat: the replica applies engine.encode_chat instead
    sampling: dict[str, Any] = field(default_factory=dict)  # engine.SamplingParams kwargs
    priority: int = 0  # lower = sooner


@dataclass(slots=True)
class ChoiceDelta:
    index: int  # choice index within the engine request (0..n-1)
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    logprobs: list[dict[int, float]] | None = None  # one dict per new token
    finish_reason: str | None = None  # set on the choice's last chunk


@dataclass(slots=True)
class StreamChunk:
    deltas: list[ChoiceDelta] = field(default_factory=list)  # coalesced, one per changed index
    num_prompt_tokens: int = 0  # prompt length (every chunk; cheap)
    finished: bool = False  # True on the last chunk of the request
    error: ErrorInfo | None = None  # set instead of deltas when the request failed


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    """A replica's load snapshot, pushed to the router every `stats_report_interval_s`."""

    replica_id: str  # Serve unique replica id (what the ingress pins to)
    num_waiting: int  # engine's waiting queue
    num_running: int  # engine's running batch
    num_free_blocks: int  # free KV blocks (incl. evictable cached ones)
    num_total_blocks: int  # KV pool size
    kv_usage: float  # 0..1
    num_queued_tokens: int  # prompt tokens waiting in the engine (0 if the engine does not say)
    block_size: int  # tokens per block
    received_ids: tuple[str, ...]  # requests that reached the engine since the last report
    reported_at: float  # time.monotonic() on the replica (informational)


@dataclass(slots=True, frozen=True)
class AdmitRequest:
    request_id: str  # same id the replica will see
    priority: int  # lower = sooner
    num_prompt_tokens: int  # for KV headroom and SJF
    max_new_tokens: int  # n * max_tokens, for SJF and the token bound
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's first full blocks


@dataclass(slots=True, frozen=True)
class AdmitResult:
    replica_id: str | None  # the replica to stream from; None when refused
    error: ErrorInfo | None = None  # 429 (queue full) / 503 (no replica) when refused
    queue_wait_s: float = 0.0  # time spent in the router's queue
