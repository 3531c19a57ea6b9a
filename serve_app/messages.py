"""Typed objects that cross deployment boundaries (ingress <-> router <-> replica).

Owns: plain picklable dataclasses, no logic. Sampling options cross as the engine's own
SamplingParams (validated once, at the ingress) and outputs as its CompletionOutput deltas.
Errors travel as values (`ErrorInfo`), not exceptions, so the ingress can answer them in OpenAI's
shape without unwrapping Ray exception chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.outputs import CompletionOutput
from engine.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True, frozen=True)
class ErrorInfo:
    status: int  # HTTP status the ingress should answer with
    message: str  # human-readable, names the field/numbers
    type: str = "invalid_request_error"  # OpenAI error type
    param: str | None = None  # offending request field, if any
    code: str | None = None  # OpenAI error code (e.g. context_length_exceeded)
    retry_after_s: int | None = None  # for 429/503: seconds until a retry makes sense


@dataclass(slots=True, frozen=True)
class ModelInfo:
    served_model_name: str  # the name clients pass as `model`
    max_model_len: int  # prompt + output tokens a request may use
    block_size: int  # KV block size, for prefix hashes and block estimates
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)
    hidden_size: int  # an embedding's size
    tokenizer: PreTrainedTokenizerBase  # the engine's: the ingress tokenizes with it, once per prompt
    chat_format: ChatOutputFormat  # how the model writes reasoning and tool calls


@dataclass(slots=True, frozen=True)
class EngineRequest:
    request_id: str  # unique per engine request (one prompt, n samples)
    prompt_token_ids: list[int]  # tokenized (and chat-templated) once, at the ingress
    params: SamplingParams | PoolingParams  # validated at the ingress; PoolingParams: an embedding
    priority: int = 0  # lower = sooner
    waited_s: float = 0.0  # time already spent in the router's queue: the engine ages it from there
    beam_search: BeamSearchParams | None = None  # set: a beam search (params' n and max_tokens are its own)
    lora: str | None = None  # the LoRA adapter it runs with
    lora_path: str | None = None  # where that adapter is, when it was loaded at run time (/v1/load_lora_adapter)


@dataclass(slots=True)
class StreamChunk:
    outputs: list[CompletionOutput] = field(default_factory=list)  # coalesced deltas, one per changed index
    num_prompt_tokens: int = 0  # prompt length (every chunk; cheap)
    finished: bool = False  # True on the last chunk of the request
    error: ErrorInfo | None = None  # set instead of outputs when the request failed
    prompt_logprobs: list[tuple[int, dict[int, float] | None]] | None = None  # (token, logprobs), once, if asked
    embedding: list[float] | None = None  # an embedding request's, on its last chunk


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    """A replica's load snapshot, pushed to the router when it changes (and as a heartbeat)."""

    replica_id: str  # Serve unique replica id (what the ingress pins to)
    model: str  # the served model it runs (its name clients pass as `model`)
    ready: bool  # the engine takes requests (False while its step loop restarts)
    num_waiting: int  # engine's waiting queue
    num_running: int  # engine's running batch
    max_num_seqs: int  # the engine's batch slots: requests beyond them wait
    num_free_blocks: int  # free KV blocks (incl. evictable cached ones)
    num_total_blocks: int  # KV pool size
    kv_usage: float  # 0..1
    num_queued_tokens: int  # tokens waiting in the engine
    block_size: int  # tokens per block
    received_ids: tuple[str, ...]  # requests that reached the engine since the last report
    ended_ids: tuple[str, ...]  # requests that ended since the last report, no longer in these counts
    reported_at: float  # time.monotonic() on the replica (informational)
    adapters: tuple[str, ...] = ()  # LoRA adapters its engine holds loaded


@dataclass(slots=True, frozen=True)
class AdmitRequest:
    request_id: str  # same id the replica will see
    model: str  # the served model it is for: only that model's replicas may take it
    priority: int  # lower = sooner
    num_prompt_tokens: int  # for KV headroom and SJF
    max_tokens: int  # per sample: with the prompt, the engine's SJF estimate
    n: int = 1  # samples: the work bound counts n * max_tokens
    prefix_hashes: tuple[int, ...] = ()  # the engine's block hashes of the prompt's first full blocks
    adapter: str | None = None  # its LoRA adapter: a replica holding it is preferred

    @property
    def num_work_tokens(self) -> int:
        """Tokens this request may compute in all (what the queue's token bound counts)."""
        return self.num_prompt_tokens + self.n * self.max_tokens


@dataclass(slots=True, frozen=True)
class AdmitResult:
    replica_id: str | None  # the replica to stream from; None when refused
    error: ErrorInfo | None = None  # 429 (queue full) / 503 (no replica) when refused
    queue_wait_s: float = 0.0  # time spent in the router's queue


# ---------------------------------------------------------------- the transport's (serve_app.transport)

Batch = list[tuple[str, StreamChunk]]  # (request id, chunk) pairs: one channel message


@dataclass(slots=True, frozen=True)
class Open:
    channel_id: str
    replica_id: str  # the replica it is for (Serve's handle may reach another while it does not list that one)


@dataclass(slots=True, frozen=True)
class Submit:
    channel_id: str
    replica_id: str
    requests: list[EngineRequest]


@dataclass(slots=True, frozen=True)
class Abort:
    replica_id: str
    request_ids: list[str]
