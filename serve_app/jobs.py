"""One HTTP request's engine requests ("jobs": one per prompt, n samples each): how they are
built from a validated request, run, and answered.

A job runs top-down: admitted (serve_app.admission: the replica to stream from, or a refusal),
streamed from that replica (serve_app.replicas), released as soon as it ends; a replica that
failed is reported lost to the admission. Owns: turning token ids into EngineRequest +
AdmitRequest with the engine's own rules (token range, context length, SamplingParams, prefix
block hashes), the jobs' flow, and assembling their chunks into one JSON response or one SSE
stream. Does not own: HTTP parsing or auth (ingress.py), wire shapes (serve_app.api).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response

from engine.beam_search import BeamSearchParams
from engine.kv_cache.hashing import adapter_cache_root, extend_block_hashes
from engine.sampling_params import PoolingParams, SamplingParams
from engine.tokenization import check_context_length, check_logit_bias, check_token_ids
from serve_app.admission import Admission
from serve_app.api.outputs import Formatter, StreamFormatter
from serve_app.api.wire import APIError
from serve_app.messages import AdmitRequest, EngineRequest, ModelInfo, StreamChunk
from serve_app.replicas import Replicas
from serve_app.served_model import Adapter, ServedModel
from serve_app.transport import ReplicaUnavailable

logger = logging.getLogger("cbserve.ingress")
MAX_PREFIX_BLOCKS = 32  # the router's affinity key covers at most this many leading blocks


class SamplingRequest(Protocol):
    """A validated API request, as a job needs it (serve_app.api's request models)."""

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams: ...

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None: ...


@dataclass(frozen=True)
class Target:
    """Where a request's jobs run, and how soon: the served model it names, the LoRA adapter (its
    name and its path where it was loaded at run time, or (None, None)), the priority its key allows."""
    model: ServedModel
    adapter: Adapter
    priority: int


@dataclass(frozen=True)
class Sampling:
    """How a request's jobs generate. `max_tokens`: the request's own, else the most of
    `default_max_tokens` that fits the context; `param`: the field a refused prompt is reported
    under; `chat_turn`: the parameters made a chat turn's (engine.chat_output.ChatOutputFormat.
    sampling_params)."""
    req: SamplingRequest
    max_tokens: int | None
    default_max_tokens: int
    num_logprobs: int | None = None
    param: str = "prompt"
    chat_turn: Callable[[SamplingParams], SamplingParams] | None = None


@dataclass(frozen=True)
class Job:
    engine_request: EngineRequest
    admit: AdmitRequest
    choice_offset: int  # this job's choice indices start here in the response


def make_job(request_id: str, prompt_ids: list[int], target: Target, sampling: Sampling, choice_offset: int) -> Job:
    """A prompt's job, its choices from `choice_offset` in the response. Raises
    engine.errors.InvalidRequestError (a 400) for what the engine would refuse."""
    info = target.model.info
    check_token_ids(prompt_ids, info.vocab_size)
    num_prompt = len(prompt_ids)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(sampling.default_max_tokens, info.max_model_len - num_prompt))
    params = sampling.req.sampling_params(max_tokens, sampling.num_logprobs)
    if sampling.chat_turn is not None:
        params = sampling.chat_turn(params)
    check_logit_bias(params, info.vocab_size)
    check_context_length(num_prompt, max_tokens, info.max_model_len, sampling.param)
    lora, lora_path = target.adapter
    return Job(EngineRequest(request_id, prompt_ids, params, target.priority,
                             beam_search=sampling.req.beam_search_params(max_tokens), lora=lora, lora_path=lora_path),
               _admission(request_id, prompt_ids, info, target, max_tokens, params.num_samples), choice_offset)


def make_embedding_job(request_id: str, prompt_ids: list[int], target: Target, pooling: PoolingParams,
                       index: int) -> Job:
    """An input's embedding as an engine request, admitted as a prompt with one token to come;
    `index`: its place in the response. Raises InvalidRequestError for what the engine would refuse."""
    info = target.model.info
    check_token_ids(prompt_ids, info.vocab_size, "input")
    check_context_length(len(prompt_ids), 1, info.max_model_len, "input")
    lora, lora_path = target.adapter
    return Job(EngineRequest(request_id, prompt_ids, pooling, target.priority, lora=lora, lora_path=lora_path),
               _admission(request_id, prompt_ids, info, target, 1, 1), index)


def _admission(request_id: str, prompt_ids: list[int], info: ModelInfo, target: Target, max_tokens: int,
               n: int) -> AdmitRequest:
    """What the router sees of a job: its model, its size, its adapter, and its prompt's leading block hashes
    (the engine's, rooted at its adapter's as the engine's prefix cache is)."""
    num_prompt, bs, lora = len(prompt_ids), info.block_size, target.adapter[0]
    root = None if lora is None else adapter_cache_root(lora)
    hashes = extend_block_hashes([], prompt_ids, bs, min(num_prompt, MAX_PREFIX_BLOCKS * bs), root)
    return AdmitRequest(request_id, info.served_model_name, target.priority, num_prompt, max_tokens, n, tuple(hashes),
                        lora)


async def job_chunks(job: Job, admission: Admission, replicas: Replicas) -> AsyncGenerator[StreamChunk, None]:
    """The job's chunks, last one `finished`: admitted, streamed from the replica the admission
    names, released once it ends (however it ends). A refusal, an error chunk or a replica that
    failed raises APIError (the replica then reported lost)."""
    result = await admission.admit(job.admit)
    if result.error is not None:
        raise APIError.from_info(result.error)
    assert result.replica_id is not None  # admitted: a replica named
    try:
        request = dataclasses.replace(job.engine_request, waited_s=result.queue_wait_s)
        async with contextlib.aclosing(replicas.stream(result.replica_id, request)) as chunks:
            async for chunk in chunks:
                if chunk.error is not None:
                    raise APIError.from_info(chunk.error)
                yield chunk
                if chunk.finished:
                    return
        raise APIError(503, "replica stream ended without finishing", "service_unavailable")
    except ReplicaUnavailable as e:
        admission.replica_lost(e.replica_id)
        raise
    finally:
        admission.release(job.admit.request_id)


async def _run_job(job: Job, admission: Admission, replicas: Replicas, out: asyncio.Queue,
                   started: asyncio.Future) -> None:
    """Puts (job, chunk) per chunk and (job, None) at the end on the response's queue. An error
    before the first chunk fails `started` (it becomes the HTTP status), one after it goes on the
    queue (it becomes an error event). Its own task: each job is released as soon as it ends, which
    lets a request with more jobs than the fleet admits at once complete."""
    try:
        async with contextlib.aclosing(job_chunks(job, admission, replicas)) as chunks:
            async for chunk in chunks:
                if not started.done():
                    started.set_result(None)
                out.put_nowait((job, chunk))
        out.put_nowait((job, None))
    except Exception as e:
        if not isinstance(e, APIError):
            logger.exception("job %s failed", job.admit.request_id)
            e = APIError(500, "internal error while streaming", "internal_error")
        if started.done():
            out.put_nowait((job, e))
        else:
            started.set_exception(e)
    finally:
        if not started.done():
            started.cancel()


async def respond(jobs: list[Job], fmt: StreamFormatter, stream: bool, admission: Admission, replicas: Replicas
                  ) -> Response:
    """Runs every job; once all have their first chunk (any refusal before that is the response)
    answers with one JSON body, or an SSE stream multiplexing the jobs' chunks."""
    out, tasks = await _started(jobs, admission, replicas)
    if not stream:
        return JSONResponse(await _completed(out, tasks, fmt))
    return EventStreamResponse(_sse(out, tasks, fmt), headers={"Cache-Control": "no-cache"})


async def complete(jobs: list[Job], fmt: Formatter, admission: Admission, replicas: Replicas) -> dict[str, Any]:
    """Runs every job to its end: the formatter's whole response (an error raises APIError)."""
    return await _completed(*await _started(jobs, admission, replicas), fmt)


async def _started(jobs: list[Job], admission: Admission, replicas: Replicas
                   ) -> tuple[asyncio.Queue, list[asyncio.Task]]:
    """The jobs running, each with its first chunk in: their chunks' queue and their tasks. A
    refusal before that raises (the other jobs cancelled)."""
    out: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    started = [loop.create_future() for _ in jobs]
    tasks = [asyncio.ensure_future(_run_job(job, admission, replicas, out, s)) for job, s in zip(jobs, started)]
    try:
        await asyncio.gather(*started)
    except BaseException:
        await _cancel(tasks)
        for s in started:  # retrieve the other refusals: one is the answer
            if s.done() and not s.cancelled():
                s.exception()
        raise
    return out, tasks


async def _completed(out: asyncio.Queue, tasks: list[asyncio.Task], fmt: Formatter) -> dict[str, Any]:
    try:
        async for batch, _ in _arrived(out, len(tasks)):
            for job, chunk in batch:
                fmt.add(chunk, job.choice_offset)
    finally:
        await _cancel(tasks)
    return fmt.response()


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _arrived(out: asyncio.Queue, num_jobs: int
                   ) -> AsyncGenerator[tuple[list[tuple[Job, StreamChunk]], bool], None]:
    """The jobs' chunks in arrival order, in batches of those that arrived together, each with
    whether every job had ended by then; a job's error raises (after the batch before it)."""
    remaining = num_jobs
    while remaining:
        batch: list[tuple[Job, StreamChunk]] = []
        item = await out.get()
        while True:
            chunk = item[1]
            if chunk is None:
                remaining -= 1
            elif isinstance(chunk, APIError):
                if batch:
                    yield batch, False
                raise chunk
            else:
                batch.append(item)
            if not remaining or out.empty():
                break
            item = out.get_nowait()
        yield batch, not remaining


async def _sse(out: asyncio.Queue, tasks: list[asyncio.Task], fmt: StreamFormatter
               ) -> AsyncGenerator[tuple[str, bool], None]:
    """The stream as (text, more) pieces: one per batch of chunks that arrived together, the last
    one with what ends the stream in the formatter's API."""
    last = ""
    try:
        async for batch, ended in _arrived(out, len(tasks)):
            text = "".join(fmt.stream_text(chunk, job.choice_offset) for job, chunk in batch)
            if ended:
                last = text + fmt.stream_end()
            elif text:
                yield text, True
    except APIError as e:
        last = fmt.stream_error(e)
    finally:
        await _cancel(tasks)
    yield last, False


class EventStreamResponse(Response):
    """An SSE response from (text, more) pieces, the last with more False. Each piece is one
    ASGI message, so one socket write, and the last one ends the response in the same write:
    events that arrive together, and a stream's last events and its end, share a write.

    The client's disconnect cancels it (serve_app.front_door.CancelOnDisconnect), so its jobs are
    cancelled and the engine aborts them; Starlette's own watcher, an anyio task group, cost about
    100 us of the ingress's event loop a response, three times what the rest of the response does."""
    media_type = "text/event-stream"

    def __init__(self, pieces: AsyncIterator[tuple[str, bool]], headers: dict[str, str]):
        self.pieces = pieces
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for text, more in self.pieces:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": more})
