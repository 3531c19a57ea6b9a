"""`EngineReplica`: a plain class around one engine (app.py makes it a deployment).

Owns: building the engine through the EngineClient contract (`engine_cls` injectable, default
engine.AsyncEngine), running an `EngineRequest` on it and streaming its coalesced chunks
(serve_app.coalescer): in-process (`stream`: the colocated graph), or to a caller's channel
(`channel`, one Serve stream per caller carrying all its requests' chunks, batched as the engine
makes them ready) for requests the caller submits in batches (`submit`, aborted by `abort`);
mapping engine errors to error chunks, telling Serve whether the engine can serve
(`check_health`), and reporting its load to the router when it changes (and at least every
`stats_heartbeat_s`), at most once per output interval of the engine (its counts change no more
often). Does not own: HTTP, admission, tokenization (the ingress sends token ids), sampling
validation (the ingress built the SamplingParams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from engine.client import EngineClient
from engine.errors import EngineDeadError, InvalidRequestError
from engine.heap import collect_young_less_often
from engine.metrics import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import PoolingParams
from serve_app.autoscaling import LIVE_REQUESTS
from serve_app.coalescer import StreamCoalescer
from serve_app.config import EngineReplicaConfig
from serve_app.draft import draft_transport
from serve_app.messages import EngineRequest, ErrorInfo, ModelInfo, ReplicaStats, StreamChunk
from serve_app.metrics import ReplicaMetrics
from serve_app.protocol import APIError
from serve_app.router import Router
from serve_app.slo import SLOTarget, SLOTracker

logger = logging.getLogger("cbserve.replica")
_MIN_REPORT_GAP_S = 0.01  # reports no closer than this, or than the engine's output interval
CHANNEL_IDLE_S = 2.0  # a channel no request has used for this long ends: Serve's drain waits for open calls


class _Outbox:
    """A channel's chunks not yet sent, and how many requests send through it."""

    def __init__(self) -> None:
        self.items: list[tuple[str, StreamChunk]] = []
        self.ready = asyncio.Event()
        self.num_live = 0

    def put(self, request_id: str, chunk: StreamChunk) -> None:
        self.items.append((request_id, chunk))
        self.ready.set()

    async def take(self) -> list[tuple[str, StreamChunk]]:
        """Once `ready`: the chunks put so far, after the other streams woken by the same engine
        output have put theirs."""
        await asyncio.sleep(0)
        self.ready.clear()
        batch, self.items = self.items, []
        return batch


async def _raising(error: Exception) -> AsyncIterator[RequestOutput]:
    """A stream that ends with `error` (a request refused before it reached the engine)."""
    raise error
    yield  # an async generator


def _serve_replica_id() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


def error_info(error: Exception) -> ErrorInfo:
    """How an engine error is answered: bad input as the ingress answers it (APIError.from_invalid: 400,
    404 for an adapter nothing serves), an engine restarting 503, else 500."""
    if isinstance(error, InvalidRequestError):
        api = APIError.from_invalid(error)
        return ErrorInfo(api.status, api.message, param=api.param, code=api.code)
    if isinstance(error, EngineDeadError):
        return ErrorInfo(503, f"engine unavailable: {error}", "service_unavailable", retry_after_s=5)
    return ErrorInfo(500, f"engine error: {error}", "internal_error")


class EngineReplica:
    """One engine; streams coalesced deltas; reports load to the router.

    `report_to`: where load reports go: the Router deployment's handle, the name of the deployment
    of this app that holds the router (the ingress: the graph cannot bind it here, it binds the
    replicas), or a Router in this process; None disables reporting.
    """

    def __init__(self, config: EngineReplicaConfig, report_to: Any = None,
                 engine_cls: type[EngineClient] | None = None, replica_id: str | None = None,
                 metrics_enabled: bool = False, slo: dict[int, SLOTarget] | None = None, draft: Any = None):
        collect_young_less_often()  # each stream's objects live as long as it does (Serve freezes the rest)
        if engine_cls is None:
            from engine.async_engine import AsyncEngine

            engine_cls = AsyncEngine
        self.config = config
        self.draft = draft  # the DraftModel deployment (placement: actor); the engine calls it by name
        self.engine: EngineClient = engine_cls.from_config(config.engine_config, config.engine_process,
                                                           draft_transport(config.engine_config),
                                                           output_interval_s=config.stream_flush_interval_s)
        self.replica_id = replica_id or _serve_replica_id() or uuid.uuid4().hex[:12]
        self.slo = SLOTracker(slo or {})
        self.metrics = ReplicaMetrics(
            metrics_enabled, self.replica_id, config.model_name, self.engine.model_report,
            {(priority, name): seconds for priority, target in self.slo.targets.items()
             for name, seconds in target.objectives().items()})
        self._report_to = report_to
        self._num_received = 0
        self._unreported: dict[str, None] = {}  # received, not yet listed in a load report (ordered set)
        self._ended: dict[str, None] = {}  # ended, not yet listed in a load report (ordered set)
        self._live: set[str] = set()  # requests streaming, or submitted and not ended
        self._tasks: dict[str, asyncio.Task] = {}  # the submitted requests running, by id
        self._outboxes: dict[str, _Outbox] = {}  # by channel id: the callers' open channels
        self.num_misrouted = 0
        self._report_now: asyncio.Event | None = None
        self._report_task: asyncio.Task | None = None
        # Each report is a Serve call, paid by this process and the router's. A burst's ends would
        # send one every few ms, most with the engine's counts of its last output (StepLoop emits
        # its stats once an interval); the router counts an end at its release anyway.
        self._report_gap_s = max(_MIN_REPORT_GAP_S, config.stream_flush_interval_s)
        self._maybe_start_reporting()

    # ------------------------------------------------------------ deployment methods

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.config.model_name, self.engine.max_model_len, self.engine.block_size,
                         self.engine.vocab_size, self.engine.hidden_size, self.engine.tokenizer,
                         self.engine.chat_format)

    def stats(self) -> ReplicaStats:
        """Lists a received request only once the engine's stats count it (or it has ended), so
        the router never drops its pending admission before the load shows it, and an ended one
        once they no longer do, so the router knows which ends the counts already show."""
        received = tuple(r for r in self._unreported if r not in self._live or self.engine.has_request(r))
        ended = tuple(r for r in self._ended if not self.engine.has_request(r))
        s = self.engine.stats()
        return ReplicaStats(
            replica_id=self.replica_id, model=self.config.model_name, ready=self.engine.is_ready,
            num_waiting=s.num_waiting, num_running=s.num_running, max_num_seqs=s.max_num_seqs,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            kv_usage=s.kv_usage, num_queued_tokens=s.num_queued_tokens, block_size=self.engine.block_size,
            received_ids=received, ended_ids=ended, reported_at=time.monotonic(), adapters=s.lora_adapters)

    async def channel(self, channel_id: str, replica_hint: str | None = None
                      ) -> AsyncIterator[str | list[tuple[str, StreamChunk]]]:
        """One caller's stream of its requests' chunks: a request submitted naming this
        `channel_id` sends its chunks here, (request id, chunk) pairs batched with the others
        ready at the same moment, so each stream message costs one Serve message per caller,
        not one per request. The first message is this replica's id (the caller checks the
        channel reached the replica it names). Ends after CHANNEL_IDLE_S with no request on it,
        so Serve's drain, which waits for open calls, ends too. `replica_hint` is read by the
        pinning request router in the caller."""
        outbox = self._outboxes[channel_id] = _Outbox()
        try:
            yield self.replica_id
            while True:
                try:
                    await asyncio.wait_for(outbox.ready.wait(), CHANNEL_IDLE_S)
                except TimeoutError:
                    if outbox.num_live == 0:
                        return
                    continue
                if batch := await outbox.take():
                    yield batch
        finally:
            if self._outboxes.get(channel_id) is outbox:
                del self._outboxes[channel_id]

    async def submit(self, requests: list[EngineRequest], channel_id: str, replica_hint: str | None = None) -> bool:
        """Requests one caller sent together, each run as a task of its own putting its chunks on
        the caller's channel. False, running none of them, when that channel is not open here
        (it ended idle as they came, or the call reached another replica than the one named):
        the caller opens another and sends them again."""
        outbox = self._outboxes.get(channel_id)
        if outbox is None:
            return False
        for request in requests:
            self._start(request, replica_hint, outbox)
        return True

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """The request's coalesced chunks, for a caller in this process; closing it aborts the request."""
        self._receive(request.request_id, None)
        try:
            async with contextlib.aclosing(self._outcome(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._end(request.request_id)

    async def abort(self, request_ids: list[str], replica_hint: str | None = None) -> None:
        """Ends submitted requests whose clients left (the engine aborts each); ids not running
        here (ended already, or never sent here) are ignored."""
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (serve_app.autoscaling): the requests inside this
        replica, which a channel carries many of."""
        return {LIVE_REQUESTS: len(self._live)}

    def _receive(self, request_id: str, replica_hint: str | None) -> None:
        self._maybe_start_reporting()
        self._num_received += 1
        self._unreported[request_id] = None
        self._live.add(request_id)
        if replica_hint is not None and replica_hint != self.replica_id:
            self.num_misrouted += 1  # the pinning router missed (e.g. a stale handle view)

    def _start(self, request: EngineRequest, replica_hint: str | None, outbox: _Outbox) -> None:
        """The submitted request as a task putting its chunks in `outbox`."""
        request_id = request.request_id
        self._receive(request_id, replica_hint)
        outbox.num_live += 1
        task = self._tasks[request_id] = asyncio.ensure_future(self._put_chunks(request, outbox))

        def ended(_: asyncio.Task) -> None:
            self._tasks.pop(request_id, None)
            self._end(request_id)  # a task cancelled before it ran never entered `_outcome`
            outbox.num_live -= 1
            outbox.ready.set()

        task.add_done_callback(ended)

    async def _put_chunks(self, request: EngineRequest, outbox: _Outbox) -> None:
        async with contextlib.aclosing(self._outcome(request)) as chunks:
            async for chunk in chunks:
                outbox.put(request.request_id, chunk)

    def _end(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._ended[request_id] = None

    async def _outcome(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """The request's coalesced deltas from the engine; an error ends them as a chunk with
        `error`. Records the request's metrics and SLO verdict when it ends."""
        coalescer = StreamCoalescer(self.config.stream_flush_interval_s)
        failed = False
        try:
            if request.lora_path is not None:  # loaded at run time: this engine learns it with its first request
                self.engine.load_adapter(request.lora, request.lora_path)
            if isinstance(request.params, PoolingParams):
                stream = self._embedding(request)
            elif request.beam_search is None:
                stream = self.engine.generate(request.prompt_token_ids, request.params, request.request_id,
                                              request.priority, request.waited_s, request.lora)
            else:
                stream = self.engine.beam_search(request.prompt_token_ids, request.beam_search, request.request_id,
                                                 request.priority, request.waited_s, request.lora)
        except InvalidRequestError as e:
            stream = _raising(e)
        try:
            async with contextlib.aclosing(coalescer.coalesce(stream)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as e:  # the engine refused or failed the request: tell the client, never truncate
            failed = not isinstance(e, InvalidRequestError)  # a refused bad request is the client's
            if failed:
                logger.warning("request %s failed: %r", request.request_id, e)
            yield StreamChunk(error=error_info(e), finished=True)
        finally:
            self._end(request.request_id)
            self.metrics.record_request(request.priority, coalescer.metrics, coalescer.num_messages,
                                        coalescer.num_output_tokens, len(request.prompt_token_ids),
                                        self.config.model_name + (f":{request.lora}" if request.lora else ""))
            if coalescer.finished or failed:  # a client that left, or bad input, is no verdict on the service
                self._record_slo(request.priority, coalescer, ok=not failed)
            if self._report_now is not None:
                self._report_now.set()

    async def _embedding(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        yield await self.engine.embed(request.prompt_token_ids, request.params, request.request_id, request.priority,
                                      request.waited_s, request.lora)

    def _record_slo(self, priority: int, coalescer: StreamCoalescer, ok: bool) -> None:
        timings = coalescer.metrics
        ttft = timings.ttft if timings is not None else None
        tpot = timings.time_per_output_token(coalescer.num_output_tokens) if timings is not None else None
        verdicts = self.slo.record(priority, ttft, tpot, ok)
        if verdicts is not None:
            self.metrics.record_slo(priority, verdicts)

    def routing_counters(self) -> dict[str, int]:
        return {"received": self._num_received, "misrouted": self.num_misrouted}

    def engine_stats(self) -> EngineStats:
        """The engine's latest snapshot (its step counts and times for benchmarks/serve_bench.py)."""
        return self.engine.stats()

    async def check_health(self) -> None:
        """Serve's health check: raises (so Serve replaces this replica) once the engine is dead
        for good; an engine restarting its step loop is healing, not unhealthy."""
        self._maybe_start_reporting()
        self.engine.check_health()

    def shutdown(self) -> None:
        if self._report_task is not None:
            self._report_task.cancel()
        self.engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------ load reports

    def _maybe_start_reporting(self) -> None:
        if self._report_to is None or (self._report_task and not self._report_task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._report_now = asyncio.Event()
        self._report_task = loop.create_task(self._report_loop())

    async def _report(self, stats: ReplicaStats) -> None:
        if isinstance(self._report_to, Router):
            await self._report_to.report(stats)
            return
        if isinstance(self._report_to, str):
            from ray import serve

            self._report_to = serve.get_deployment_handle(self._report_to, serve.get_replica_context().app_name)
        await self._report_to.report.remote(stats)

    async def _report_loop(self) -> None:
        """Sends the load snapshot when it changed (or requests arrived), and at least every
        heartbeat; looks every stats_report_interval_s or as soon as a request ends, but never
        within `_report_gap_s` of its last look."""
        assert self._report_now is not None
        last_key, last_sent = None, -float("inf")
        while True:
            try:
                stats = self.stats()
                key = (stats.ready, stats.num_waiting, stats.num_running, stats.num_free_blocks,
                       stats.num_queued_tokens)
                due = time.monotonic() - last_sent >= self.config.stats_heartbeat_s
                if key != last_key or stats.received_ids or stats.ended_ids or due:
                    for request_id in stats.received_ids:
                        self._unreported.pop(request_id, None)
                    for request_id in stats.ended_ids:
                        self._ended.pop(request_id, None)
                    self.metrics.record_load(stats, self.engine.stats())
                    self.metrics.record_slo_window(self.slo.window())
                    await self._report(stats)
                    last_key, last_sent = key, time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("load report to router failed", exc_info=True)
            await asyncio.sleep(self._report_gap_s)
            try:
                await asyncio.wait_for(self._report_now.wait(), timeout=self.config.stats_report_interval_s)
            except TimeoutError:
                pass
            self._report_now.clear()
