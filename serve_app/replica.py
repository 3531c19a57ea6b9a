"""`EngineReplica`: a plain class around one engine (app.py makes it a deployment).

Owns: building the engine through the EngineClient contract (`engine_cls` injectable, default
engine.AsyncEngine), running an `EngineRequest` on it and streaming its coalesced chunks
(serve_app.coalescer): in-process (`stream`: the colocated graph), or over the channels of
serve_app.transport (`channel`, `submit`, `abort`);
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
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Protocol

from engine.client import EngineClient
from engine.errors import EngineDeadError, InvalidRequestError
from engine.gc_settings import collect_young_less_often
from engine.metrics import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import PoolingParams
from serve_app.api.wire import APIError
from serve_app.autoscaling import LIVE_REQUESTS
from serve_app.coalescer import StreamCoalescer
from serve_app.config import EngineReplicaConfig
from serve_app.draft import draft_transport
from serve_app.messages import (
    Abort,
    Batch,
    EngineRequest,
    ErrorInfo,
    ModelInfo,
    Open,
    ReplicaStats,
    StreamChunk,
    Submit,
)
from serve_app.metrics import ReplicaMetrics
from serve_app.slo import SLOTarget, SLOTracker
from serve_app.transport import ReplicaChannels

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("cbserve.replica")
_MIN_REPORT_GAP_S = 0.01  # reports no closer than this, or than the engine's output interval


async def _raising(error: Exception) -> AsyncGenerator[RequestOutput, None]:
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


class LoadReports(Protocol):
    """Where an engine replica's load reports go: a Router in this process, or RouterByName."""

    async def report(self, stats: ReplicaStats) -> None: ...


class RouterByName:
    """The deployment of this app that holds the router (`Router`, or `IngressRouter`), by its
    name: the graph binds the engine replicas before the deployment holding the router, so it
    cannot hand them its handle. Looked up at the first report."""

    def __init__(self, deployment: str):
        self.deployment = deployment
        self._handle: DeploymentHandle | None = None

    async def report(self, stats: ReplicaStats) -> None:
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment, serve.get_replica_context().app_name)
        await self._handle.report.remote(stats)


class EngineReplica:
    """One engine; streams coalesced deltas; reports load to the router (`reports`; None: no
    reports)."""

    def __init__(self, config: EngineReplicaConfig, reports: LoadReports | None = None,
                 engine_cls: type[EngineClient] | None = None, replica_id: str | None = None,
                 metrics_enabled: bool = False, slo: dict[int, SLOTarget] | None = None,
                 draft: object | None = None):
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
        self._reports = reports
        self._num_received = 0
        self._unreported: dict[str, None] = {}  # received, not yet listed in a load report (ordered set)
        self._ended: dict[str, None] = {}  # ended, not yet listed in a load report (ordered set)
        self._live: set[str] = set()  # requests streaming, or submitted and not ended
        self.channels = ReplicaChannels(self.replica_id, self._outcome, self._end)  # serve_app.transport's
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

    async def channel(self, message: Open) -> AsyncGenerator[str | Batch, None]:
        """A caller's channel: its submitted requests' chunks (serve_app.transport)."""
        async with contextlib.aclosing(self.channels.open(message)) as items:
            async for item in items:
                yield item

    async def submit(self, message: Submit) -> bool:
        """Requests a caller sent together, run on its channel; False, running none, when that
        channel is not open here."""
        if message.replica_id != self.replica_id:
            self.num_misrouted += len(message.requests)  # the pinning router missed (e.g. a stale handle view)
        if not self.channels.submit(message):
            return False
        for request in message.requests:
            self._receive(request.request_id)
        return True

    async def abort(self, message: Abort) -> None:
        """Ends submitted requests whose clients left (the engine aborts each)."""
        self.channels.abort(message)

    async def stream(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        """The request's coalesced chunks, for a caller in this process; closing it aborts the request."""
        self._receive(request.request_id)
        try:
            async with contextlib.aclosing(self._outcome(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._end(request.request_id)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (serve_app.autoscaling): the requests inside this
        replica, which a channel carries many of."""
        return {LIVE_REQUESTS: len(self._live)}

    def _receive(self, request_id: str) -> None:
        self._maybe_start_reporting()
        self._num_received += 1
        self._unreported[request_id] = None
        self._live.add(request_id)

    def _end(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._ended[request_id] = None

    async def _outcome(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        """The request's coalesced deltas from the engine; an error ends them as a chunk with
        `error`. Records the request's metrics and SLO verdict when it ends."""
        coalescer = StreamCoalescer(self.config.stream_flush_interval_s)
        failed = False
        stream: AsyncIterator[RequestOutput]
        try:
            if request.lora is not None and request.lora_path is not None:  # loaded at run time: learnt with its first
                # request for it
                self.engine.load_adapter(request.lora, request.lora_path)
            if isinstance(request.params, PoolingParams):
                stream = self._embedding(request, request.params)
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

    async def _embedding(self, request: EngineRequest, params: PoolingParams) -> AsyncGenerator[RequestOutput, None]:
        yield await self.engine.embed(request.prompt_token_ids, params, request.request_id, request.priority,
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
        if self._reports is None or (self._report_task and not self._report_task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._report_now = asyncio.Event()
        self._report_task = loop.create_task(self._report_loop())

    async def _report_loop(self) -> None:
        """Sends the load snapshot when it changed (or requests arrived), and at least every
        heartbeat; looks every stats_report_interval_s or as soon as a request ends, but never
        within `_report_gap_s` of its last look."""
        reports = self._reports
        assert self._report_now is not None and reports is not None  # started only with both
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
                    await reports.report(stats)
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
