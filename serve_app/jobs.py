"""One HTTP request's engine requests ("jobs": one per prompt, n samples each): how they are
built from a validated request, admitted, streamed and answered.

Owns: turning token ids into EngineRequest + AdmitRequest with the engine's own rules (token
range, context length, SamplingParams, prefix block hashes), the per-job flow `admit at the
router -> stream from the named replica (submitted in batches, its chunks over the replica's
channel when one is open: serve_app.submissions) -> release`, and assembling the jobs' chunks
into one JSON response or one SSE stream. Does not own: HTTP parsing or auth (ingress.py), wire
shapes (protocol.py, formatting.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from engine.beam_search import BeamSearchParams
from engine.kv_cache.hashing import extend_block_hashes
from engine.sampling_params import SamplingParams
from engine.tokenization import check_context_length, check_logit_bias, check_token_ids
from serve_app.call_ids import own_serve_request_id
from serve_app.config import AppConfig
from serve_app.formatting import Formatter
from serve_app.messages import AdmitRequest, AdmitResult, EngineRequest, ModelInfo, StreamChunk
from serve_app.protocol import SSE_DONE, APIError, sse_event
from serve_app.submissions import Submissions

logger = logging.getLogger("cbserve.ingress")
MAX_PREFIX_BLOCKS = 32  # the router's affinity key covers at most this many leading blocks


class SamplingRequest(Protocol):
    """A validated API request, as a job needs it (protocol.py's request models)."""

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams: ...

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None: ...


class _Method(Protocol):
    def remote(self, *args: Any, **kwargs: Any) -> Any: ...


class Admissions(Protocol):
    async def admit(self, request: AdmitRequest) -> AdmitResult: ...

    def release_later(self, request_id: str) -> None: ...


class ReplicaStreams(Protocol):
    generate: _Method  # (EngineRequest, replica_hint=) -> a stream of StreamChunk


class JobHost(Protocol):
    """What a job's flow needs of the ingress that runs it: admission and release at the router
    (batched, serve_app.admit_batches), the replicas as a Serve handle (or serve_app.local's
    shim), the batches that submit requests beside the replicas' stream channels (None: each
    request a call of its own), the replica accept timeout, and fire-and-forget router calls
    that outlive the job."""
    config: AppConfig
    admissions: Admissions
    replica_streams: ReplicaStreams
    submissions: Submissions | None

    def call_router_later(self, method: str, arg: str | None) -> None: ...


@dataclass(frozen=True)
class Job:
    engine_request: EngineRequest
    admit: AdmitRequest
    choice_offset: int  # this job's choice indices start here in the response


def make_job(request_id: str, prompt_ids: list[int], *, req: SamplingRequest, info: ModelInfo,
             max_tokens: int | None, default_max_tokens: int, num_logprobs: int | None, priority: int,
             choice_offset: int, param: str) -> Job:
    """`max_tokens`: the request's own, else the largest of `default_max_tokens` that fits the
    context; `choice_offset`: where this job's choice indices start in the response; `param`: the
    field a refused prompt is reported under. Raises engine.errors.InvalidRequestError (a 400)
    for what the engine would refuse."""
    check_token_ids(prompt_ids, info.vocab_size)
    num_prompt = len(prompt_ids)
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, info.max_model_len - num_prompt))
    params = req.sampling_params(max_tokens, num_logprobs)
    check_logit_bias(params, info.vocab_size)
    check_context_length(num_prompt, max_tokens, info.max_model_len, param)
    bs = info.block_size
    hashes = extend_block_hashes([], prompt_ids, bs, min(num_prompt, MAX_PREFIX_BLOCKS * bs))
    return Job(EngineRequest(request_id, prompt_ids, params, priority, beam_search=req.beam_search_params(max_tokens)),
               AdmitRequest(request_id, priority, num_prompt, max_tokens, params.best_of, tuple(hashes)), choice_offset)


def check_fits_queue(jobs: list[Job], max_queued_tokens: int) -> None:
    """A request whose work exceeds the router's whole queue could never be admitted: 413, not
    a 429 that no retry can cure."""
    work = sum(job.admit.num_work_tokens for job in jobs)
    if work > max_queued_tokens:
        raise APIError(413, f"This request needs {work} tokens of work (prompts + n * max_tokens); the "
                            f"admission queue holds at most {max_queued_tokens}. Split it or lower max_tokens.",
                       param="max_tokens", code="request_too_large")


class JobStream:
    """One job's flow, as its own task: admit -> stream every chunk into the response's queue ->
    release as soon as the job finishes. Releasing per job, not per response, is what lets a
    request with more jobs than the fleet admits at once complete."""

    def __init__(self, ingress: JobHost, job: Job, out: asyncio.Queue):
        self.ingress, self.job, self._out = ingress, job, out
        self._gen: Any = None  # the job's own call, where requests are not submitted in batches
        # Submitted in a batch: its chunks, an APIError if the channel or the call failed, or None
        # if the call ended without finishing it (serve_app.submissions)
        self._chunks: asyncio.Queue | None = None
        self._submitted = False
        self._ended_at_replica = False  # its last chunk came: nothing to abort
        self._admitted = False
        self._replica_id: str | None = None
        self.started: asyncio.Future = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        """Puts (job, chunk) per chunk and (job, None) at the end on the queue; an error before
        the first chunk fails `started` (it becomes the HTTP status), one after it goes on the
        queue (it becomes an error event)."""
        try:
            await self._admit()
            chunk = await self._next()
            while chunk is not None:
                self._ended_at_replica = chunk.finished
                if chunk.error is not None:
                    raise APIError.from_info(chunk.error)
                if not self.started.done():
                    self.started.set_result(None)
                self._out.put_nowait((self.job, chunk))
                if chunk.finished:
                    if self._gen is not None:
                        await self._next()  # its call ends
                    self._out.put_nowait((self.job, None))
                    return
                chunk = await self._next()
            raise APIError(503, "replica stream ended without finishing", "service_unavailable")
        except APIError as e:
            self._fail(e)
        except Exception:
            logger.exception("job %s failed", self.job.admit.request_id)
            self._fail(APIError(500, "internal error while streaming", "internal_error"))
        finally:
            if not self.started.done():
                self.started.cancel()
            self.close()

    def _fail(self, error: APIError) -> None:
        if self.started.done():
            self._out.put_nowait((self.job, error))
        else:
            self.started.set_exception(error)

    async def _admit(self) -> None:
        own_serve_request_id()
        result = await self.ingress.admissions.admit(self.job.admit)
        if result.error is not None:
            raise APIError.from_info(result.error)
        self._admitted = True
        self._replica_id = result.replica_id
        request = dataclasses.replace(self.job.engine_request, waited_s=result.queue_wait_s)
        submissions = self.ingress.submissions
        if submissions is not None:
            self._submitted = True
            self._chunks = await submissions.submit(result.replica_id, request)
            return
        self._gen = self.ingress.replica_streams.generate.remote(request, replica_hint=result.replica_id)
        await self._accepted()

    async def _accepted(self) -> None:
        """Waits for the replica's acknowledgement of the job's own call. A call to a replica that
        died after the router chose it waits in Serve's handle for a replica to exist, which may be
        never (its node is gone and no other can host it): past the deadline the replica is
        reported lost and the client gets a 503."""
        timeout = self.ingress.config.ingress.replica_accept_timeout_s
        try:
            chunk = await asyncio.wait_for(self._next(), timeout)
        except TimeoutError:
            logger.warning("replica %s did not accept %s within %.1f s", self._replica_id,
                           self.job.admit.request_id, timeout)
            self.ingress.call_router_later("remove_replica", self._replica_id)
            raise APIError(503, "the engine replica chosen for this request is unreachable; retry",
                           "service_unavailable") from None
        if chunk is None or not chunk.accepted:
            raise APIError(503, "replica stream ended before accepting the request", "service_unavailable")

    async def _next(self) -> StreamChunk | None:
        if self._chunks is None:
            return await self._next_on_call()
        item = await self._chunks.get()
        if isinstance(item, APIError):
            raise item
        return item

    async def _next_on_call(self) -> StreamChunk | None:
        try:
            return await self._gen.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # replica died / unavailable
            logger.warning("replica stream failed: %r", e)
            self.ingress.call_router_later("remove_replica", self._replica_id)
            raise APIError(503, f"engine replica failed: {type(e).__name__}", "service_unavailable") from None

    def close(self) -> None:
        request_id = self.job.admit.request_id
        if self._submitted:
            self._submitted = False
            assert self.ingress.submissions is not None
            self.ingress.submissions.end(request_id, finished=self._ended_at_replica)
        if self._gen is not None:
            cancel = getattr(self._gen, "cancel", None)
            if cancel is not None:
                cancel()
            self._gen = None
        if self._admitted:
            self._admitted = False
            self.ingress.admissions.release_later(self.job.admit.request_id)


async def respond(ingress: JobHost, jobs: list[Job], fmt: Formatter, stream: bool):
    """Starts every job; once all have their first chunk (any refusal before that is the
    response) answers with one JSON body, or an SSE stream multiplexing the jobs' chunks."""
    out: asyncio.Queue = asyncio.Queue()
    streams = [JobStream(ingress, job, out) for job in jobs]
    tasks = [asyncio.ensure_future(s.run()) for s in streams]
    try:
        await asyncio.gather(*(s.started for s in streams))
    except BaseException:
        await _cancel(tasks)
        for s in streams:  # retrieve the other refusals: one is the answer
            if s.started.done() and not s.started.cancelled():
                s.started.exception()
        raise
    if not stream:
        try:
            async for batch, _ in _arrived(out, len(jobs)):
                for job, chunk in batch:
                    fmt.add(chunk, job.choice_offset)
        finally:
            await _cancel(tasks)
        return JSONResponse(fmt.response())
    return EventStreamResponse(_sse(out, tasks, fmt), headers={"Cache-Control": "no-cache"})


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _arrived(out: asyncio.Queue, num_jobs: int) -> AsyncIterator[tuple[list[tuple[Job, StreamChunk]], bool]]:
    """The jobs' chunks in arrival order, in batches of those that arrived together, each with
    whether every job had ended by then; a job's error raises (after the batch before it)."""
    remaining = num_jobs
    while remaining:
        batch = []
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


async def _sse(out: asyncio.Queue, tasks: list[asyncio.Task], fmt: Formatter) -> AsyncIterator[tuple[str, bool]]:
    """The stream as (text, more) pieces: one per batch of chunks that arrived together, the last
    one with the usage event and [DONE]."""
    last = ""
    try:
        async for batch, ended in _arrived(out, len(tasks)):
            text = "".join(sse_event(event) for job, chunk in batch
                           for event in fmt.stream_events(chunk, job.choice_offset))
            if ended:
                usage_event = fmt.usage_event()
                last = text + (sse_event(usage_event) if usage_event is not None else "")
            elif text:
                yield text, True
    except APIError as e:
        last = sse_event(e.body())
    finally:
        await _cancel(tasks)
    yield last + SSE_DONE, False


class EventStreamResponse(StreamingResponse):
    """An SSE response from (text, more) pieces, the last with more False. Each piece is one
    ASGI message, so one socket write, and the last one ends the response in the same write:
    events that arrive together, and a stream's last events and its end, share a write.

    The client's disconnect ends the stream (its jobs are cancelled, so the engine aborts them),
    watched by one plain task: Starlette's anyio task group for it cost about 100 us of the
    ingress's event loop a response, three times what the rest of the response does."""
    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, streaming))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # the watcher's cancellation is the client's end; any other one is the server's
            if not watcher.done() or watcher.cancelled() or streaming.uncancel() > 0:
                raise
        finally:
            watcher.cancel()

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for text, more in self.body_iterator:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": more})


async def _cancel_on_disconnect(receive: Any, task: asyncio.Task) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()
