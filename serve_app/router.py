"""Global admission: one router for the fleet, a queue per model ordered by policy, dispatch to
one of that model's replicas with headroom.

Owns: the Router deployment's flow: each request of an `admit_many()` call (an ingress's batch,
serve_app.admission.RouterClient), or of `admit()` in-process, waits in its model's AdmissionQueue
(serve_app.admission_queue) until the model's ReplicaPool (serve_app.replica_pool) has a replica
with headroom and names it; bounds per model (-> 429 + Retry-After from that model's drain rate);
503 when a model has no live replica. Does not own: tokens. The router is off the token path:
the ingress streams from the named replica directly and calls `release()`.

Models (`_Lane`): every queue ranks by the same rule (engine.scheduler.queue.rank_key, one clock),
so priorities and aging mean the same for every model; each model's requests run only on its own
replicas, so each queue dispatches against its own pool and a model without room holds back only
its own requests, never another model's.

Invariants (checked by tests):
- A request leaves the queue only when some live replica of its model has headroom: its
  estimated waiting queue is below `max_waiting_per_replica` and its estimated free KV blocks
  cover the prompt (an idle replica always has headroom, so a prompt larger than free blocks
  cannot deadlock).
- Dispatch is in rank order within a model (among a class's LoRA adapters, each adapter's in
  turn: serve_app.admission_queue): if the request whose turn it is fits nowhere, none of that
  model's overtakes it.
- Estimates = last report + what was admitted to that replica but not yet seen by its engine
  (replicas list the request ids that reached them since their previous report) - what ended
  there since (`release()`), counted as waiting beyond the engine's batch slots (`max_num_seqs`):
  the router never polls per request, admissions fill free slots at once, and a freed slot is
  refilled at its release, not a report later.
- The wait here is passed on (`AdmitResult.queue_wait_s`): the engine ages the request from
  its arrival at the router, so its rank is continuous across the hop.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable

from serve_app.admission_queue import AdmissionQueue, QueueEntry
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, AdmitResult, ErrorInfo, ReplicaStats
from serve_app.metrics import RouterMetrics
from serve_app.replica_pool import ReplicaPool

_TICK_S = 0.1  # while requests wait: aging re-ranks them, and a fleet with no replica fails them
_IDLE_TICK_S = 1.0  # with none waiting only silent replicas expire (after seconds), so the actor wakes less


class _Lane:
    """One model's admission: its queue, its replicas, its recent dispatches (the drain rate a
    429's Retry-After is read from), and since when it has had no live replica."""

    def __init__(self, model: str, config: RouterConfig):
        self.model = model
        self.queue = AdmissionQueue(config)
        self.pool = ReplicaPool(config)
        self.dispatch_times: deque[float] = deque(maxlen=512)
        self.no_replica_since: float | None = None


class Router:
    """The Router deployment (plain class; `app.py` applies serve.deployment), or an object inside
    the one ingress replica's actor (serve_app.frontend), which with one engine replica is the
    engine's actor too."""

    def __init__(self, config: RouterConfig, metrics_enabled: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.lanes: dict[str, _Lane] = {}  # by served model name, made by its first request or report
        self.metrics = RouterMetrics(metrics_enabled)
        self._clock = clock
        self._tick_task: asyncio.Task | None = None
        self._maybe_start_ticker()

    # ------------------------------------------------------------ deployment methods

    async def admit(self, request: AdmitRequest) -> AdmitResult:
        """One request's admission, in-process (serve_app.admission.LocalAdmission): the replica to
        stream from once one has headroom, or its refusal. Cancelled, it leaves the queue (or
        its admission is released)."""
        self._maybe_start_ticker()
        queued = self._enqueue(request)
        if isinstance(queued, AdmitResult):
            return queued
        lane = self.lanes[request.model]
        self._dispatch(lane)
        assert queued.future is not None
        try:
            return await asyncio.shield(queued.future)
        except asyncio.CancelledError:
            if not queued.future.cancelled():  # not released while queued: the caller left
                self._withdraw(queued)
                self._dispatch(lane)
            raise

    async def admit_many(self, requests: list[AdmitRequest]) -> AsyncGenerator[list[tuple[str, AdmitResult]], None]:
        """Admissions asked together by an ingress of the split graph (serve_app.admission.RouterClient:
        those that came while its previous batch was on its way; each call costs the router and the
        ingress a Serve message, and a burst's requests come together). The first message answers
        at once (an empty list too: the ingress's acknowledgement that every request is queued
        here); then each later message holds the results that came at one moment, until every
        request has one. A request released while
        queued (its client left) gets none. A call that ends first withdraws the ones it holds."""
        self._maybe_start_ticker()
        answers: list[tuple[str, AdmitResult]] = []
        waiting: dict[str, QueueEntry] = {}
        for request in requests:
            queued = self._enqueue(request)
            if isinstance(queued, AdmitResult):
                answers.append((request.request_id, queued))
            else:
                waiting[request.request_id] = queued
        self._dispatch_all()
        resolved: list[str] = []
        came = asyncio.Event()

        def on_result(request_id: str, _: asyncio.Future) -> None:
            resolved.append(request_id)
            came.set()

        for request_id, entry in waiting.items():
            assert entry.future is not None
            if entry.future.done():
                resolved.append(request_id)
            else:
                entry.future.add_done_callback(functools.partial(on_result, request_id))
        first = True
        try:
            while True:
                for request_id in resolved:
                    future = waiting.pop(request_id).future
                    assert future is not None
                    if not future.cancelled():  # cancelled: released while queued
                        answers.append((request_id, future.result()))
                resolved.clear()
                if answers or first:
                    yield answers
                    answers, first = [], False
                if not waiting:
                    return
                while not resolved:
                    came.clear()
                    await came.wait()
        finally:
            for entry in waiting.values():
                self._withdraw(entry)
            if waiting:
                self._dispatch_all()

    def _lane(self, model: str) -> _Lane:
        lane = self.lanes.get(model)
        if lane is None:
            lane = self.lanes[model] = _Lane(model, self.config)
        return lane

    def _enqueue(self, request: AdmitRequest) -> QueueEntry | AdmitResult:
        """The request queued in its model's queue with a future for its result, or its refusal
        (429) if that queue is full."""
        lane = self._lane(request.model)
        queue = lane.queue
        if not queue.can_accept(request):
            self.metrics.rejections.inc(tags={"model": lane.model, "reason": "queue_full"})
            retry = self.retry_after_s(lane)
            return AdmitResult(None, ErrorInfo(
                429, f"admission queue full for model '{lane.model}' ({len(queue)} requests, {queue.num_tokens} "
                     f"tokens queued; limits {self.config.max_queued_requests} requests, "
                     f"{self.config.max_queued_tokens} tokens); retry in {retry}s",
                type="rate_limit_exceeded", retry_after_s=retry))
        entry = queue.push(request, self._clock())
        entry.future = asyncio.get_running_loop().create_future()
        self.metrics.record_depth(lane.model, request.priority, queue.depth_by_priority[request.priority])
        return entry

    def _dequeue(self, lane: _Lane, request_id: str) -> QueueEntry | None:
        entry = lane.queue.remove(request_id)
        if entry is not None:
            priority = entry.request.priority
            self.metrics.record_depth(lane.model, priority, lane.queue.depth_by_priority[priority])
        return entry

    def _withdraw(self, entry: QueueEntry) -> None:
        """A request whose caller is gone: out of the queue, or released if it was admitted."""
        request = entry.request
        lane = self.lanes[request.model]
        if self._dequeue(lane, request.request_id) is not None:
            return
        if entry.future is not None and entry.future.done() and not entry.future.cancelled():
            lane.pool.release(request.request_id)

    async def release(self, request_ids: list[str]) -> None:
        """Requests that ended at an ingress, those that ended together in one call (each call
        costs the router and the ingress a Serve message, and a burst's requests end together),
        or whose clients left while they were queued here: those leave the queue unanswered."""
        self.release_now(request_ids)

    def release_now(self, request_ids: list[str]) -> None:
        """`release`, for a caller in this process."""
        for request_id in request_ids:
            for lane in self.lanes.values():  # a few models: a dict lookup each
                entry = self._dequeue(lane, request_id)
                if entry is not None:
                    if entry.future is not None:
                        entry.future.cancel()
                    break
                lane.pool.release(request_id)
        self._dispatch_all()

    async def report(self, stats: ReplicaStats) -> None:
        lane = self._lane(stats.model)
        lane.pool.report(stats, self._clock())
        self._dispatch(lane)

    async def remove_replica(self, replica_id: str) -> None:
        """Called by the ingress when a replica's stream failed (actor died): stop sending
        there now instead of waiting for its reports to go stale. A live replica that keeps
        reporting comes back with its next report."""
        self.remove_replica_now(replica_id)

    def remove_replica_now(self, replica_id: str) -> None:
        """`remove_replica`, for a caller in this process."""
        for lane in self.lanes.values():
            lane.pool.remove(replica_id)
        self._dispatch_all()

    def num_queued_admissions(self) -> int:
        """Requests waiting in the queues for an engine to have room."""
        return sum(len(lane.queue) for lane in self.lanes.values())

    async def ready_replicas(self) -> dict[str, int]:
        """Per model, the replicas whose engine takes requests now (the ingress's readiness)."""
        return {model: lane.pool.num_ready for model, lane in self.lanes.items()}

    async def check_health(self) -> None:
        self._maybe_start_ticker()

    # ------------------------------------------------------------ logic

    def retry_after_s(self, lane: _Lane) -> int:
        """Seconds until the model's queue has drained by its current length, from its drain rate."""
        now = self._clock()
        recent = [t for t in lane.dispatch_times if now - t <= 30.0]
        if len(recent) >= 2 and now > recent[0]:
            rate = len(recent) / max(now - recent[0], 1e-3)
            return int(min(60, max(1, math.ceil((len(lane.queue) + 1) / rate))))
        return 1 if recent else 5

    def _dispatch_all(self) -> None:
        for lane in self.lanes.values():
            self._dispatch(lane)

    def _dispatch(self, lane: _Lane) -> None:
        now = self._clock()
        while (entry := lane.queue.peek()) is not None:
            replica_id = lane.pool.choose(entry.request)
            if replica_id is None:
                return
            request = entry.request
            self._dequeue(lane, request.request_id)
            if entry.future is None or entry.future.done():
                continue  # the caller went away
            lane.queue.served(entry)
            lane.pool.assign(replica_id, request, now)
            lane.dispatch_times.append(now)
            wait = now - entry.arrival
            self.metrics.record_dispatch(lane.model, replica_id, request.priority, wait)
            entry.future.set_result(AdmitResult(replica_id, queue_wait_s=wait))

    def tick(self) -> None:
        """Periodic: drop silent replicas, fail a model's queued requests when it has no live replica."""
        now = self._clock()
        for lane in self.lanes.values():
            lane.pool.expire(now)
            self.metrics.live_replicas.set(len(lane.pool.views), tags={"model": lane.model})
            self.metrics.refresh_depths(lane.model, lane.queue.depth_by_priority)
            if lane.pool.views:
                lane.no_replica_since = None
            elif lane.no_replica_since is None:
                lane.no_replica_since = now
            elif now - lane.no_replica_since >= self.config.no_replica_timeout_s:
                self._fail_all(lane, ErrorInfo(503, f"no engine replica of model '{lane.model}' is available",
                                               "service_unavailable", retry_after_s=5))
            self._dispatch(lane)

    def _fail_all(self, lane: _Lane, error: ErrorInfo) -> None:
        for entry in lane.queue.entries():
            self._dequeue(lane, entry.request.request_id)
            if entry.future is not None and not entry.future.done():
                self.metrics.rejections.inc(tags={"model": lane.model, "reason": "no_replica"})
                entry.future.set_result(AdmitResult(None, error))

    def _maybe_start_ticker(self) -> None:
        if self._tick_task is not None and not self._tick_task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._tick_task = loop.create_task(self._tick_loop())

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S if any(lane.queue for lane in self.lanes.values()) else _IDLE_TICK_S)
            self.tick()
