"""Global admission: one queue ordered by policy, dispatch to the replica with headroom.

Owns: the Router deployment's flow: each request of an `admit_many()` call (an ingress's batch,
serve_app.admission.RouterClient), or of `admit()` in-process, waits in the AdmissionQueue
(serve_app.admission_queue) until the ReplicaPool (serve_app.replica_pool) has a replica with
headroom and names it; bounds (-> 429 +
Retry-After); 503 when no replica is live. Does not own: tokens. The router is off the
token path: the ingress streams from the named replica directly and calls `release()`.

Invariants (checked by tests):
- A request leaves the queue only when some live replica has headroom: its estimated waiting
  queue is below `max_waiting_per_replica` and its estimated free KV blocks cover the prompt
  (an idle replica always has headroom, so a prompt larger than free blocks cannot deadlock).
- Dispatch is strictly in rank order: if the best request fits nowhere, nobody overtakes it.
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
from collections.abc import AsyncIterator, Callable

from serve_app.admission_queue import AdmissionQueue, QueueEntry
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, AdmitResult, ErrorInfo, ReplicaStats
from serve_app.metrics import RouterMetrics
from serve_app.replica_pool import ReplicaPool

_TICK_S = 0.1  # while requests wait: aging re-ranks them, and a fleet with no replica fails them
_IDLE_TICK_S = 1.0  # with none waiting only silent replicas expire (after seconds), so the actor wakes less


class Router:
    """The Router deployment (plain class; `app.py` applies serve.deployment), or an object inside
    the one ingress replica's actor (serve_app.frontend), which with one engine replica is the
    engine's actor too."""

    def __init__(self, config: RouterConfig, metrics_enabled: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.queue = AdmissionQueue(config)
        self.pool = ReplicaPool(config)
        self.metrics = RouterMetrics(metrics_enabled)
        self._clock = clock
        self._dispatch_times: deque[float] = deque(maxlen=512)
        self._no_replica_since: float | None = None
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
        self._dispatch()
        assert queued.future is not None
        try:
            return await asyncio.shield(queued.future)
        except asyncio.CancelledError:
            if not queued.future.cancelled():  # not released while queued: the caller left
                self._withdraw(queued)
                self._dispatch()
            raise

    async def admit_many(self, requests: list[AdmitRequest]) -> AsyncIterator[list[tuple[str, AdmitResult]]]:
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
        self._dispatch()
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
                self._dispatch()

    def _enqueue(self, request: AdmitRequest) -> QueueEntry | AdmitResult:
        """The request queued with a future for its result, or its refusal (429) if it cannot be."""
        if not self.queue.can_accept(request):
            self.metrics.rejections.inc(tags={"reason": "queue_full"})
            retry = self.retry_after_s()
            return AdmitResult(None, ErrorInfo(
                429, f"admission queue full ({len(self.queue)} requests, {self.queue.num_tokens} tokens "
                     f"queued; limits {self.config.max_queued_requests} requests, "
                     f"{self.config.max_queued_tokens} tokens); retry in {retry}s",
                type="rate_limit_exceeded", retry_after_s=retry))
        entry = self.queue.push(request, self._clock())
        entry.future = asyncio.get_running_loop().create_future()
        self.metrics.record_depth(request.priority, self.queue.depth_by_priority[request.priority])
        return entry

    def _dequeue(self, request_id: str) -> QueueEntry | None:
        entry = self.queue.remove(request_id)
        if entry is not None:
            self.metrics.record_depth(entry.request.priority, self.queue.depth_by_priority[entry.request.priority])
        return entry

    def _withdraw(self, entry: QueueEntry) -> None:
        """A request whose caller is gone: out of the queue, or released if it was admitted."""
        request = entry.request
        if self._dequeue(request.request_id) is not None:
            return
        if entry.future is not None and entry.future.done() and not entry.future.cancelled():
            self.pool.release(request.request_id)

    async def release(self, request_ids: list[str]) -> None:
        """Requests that ended at an ingress, those that ended together in one call (each call
        costs the router and the ingress a Serve message, and a burst's requests end together),
        or whose clients left while they were queued here: those leave the queue unanswered."""
        self.release_now(request_ids)

    def release_now(self, request_ids: list[str]) -> None:
        """`release`, for a caller in this process."""
        for request_id in request_ids:
            entry = self._dequeue(request_id)
            if entry is None:
                self.pool.release(request_id)
            elif entry.future is not None:
                entry.future.cancel()
        self._dispatch()

    async def report(self, stats: ReplicaStats) -> None:
        self.pool.report(stats, self._clock())
        self._dispatch()

    async def remove_replica(self, replica_id: str) -> None:
        """Called by the ingress when a replica's stream failed (actor died): stop sending
        there now instead of waiting for its reports to go stale. A live replica that keeps
        reporting comes back with its next report."""
        self.remove_replica_now(replica_id)

    def remove_replica_now(self, replica_id: str) -> None:
        """`remove_replica`, for a caller in this process."""
        self.pool.remove(replica_id)
        self._dispatch()

    def num_queued_admissions(self) -> int:
        """Requests waiting in the queue for an engine to have room."""
        return len(self.queue)

    async def num_ready_replicas(self) -> int:
        """Replicas whose engine takes requests now (the ingress's readiness)."""
        return self.pool.num_ready

    async def check_health(self) -> None:
        self._maybe_start_ticker()

    # ------------------------------------------------------------ logic

    def retry_after_s(self) -> int:
        """Seconds until the queue has drained by its current length, from the drain rate."""
        now = self._clock()
        recent = [t for t in self._dispatch_times if now - t <= 30.0]
        if len(recent) >= 2 and now > recent[0]:
            rate = len(recent) / max(now - recent[0], 1e-3)
            return int(min(60, max(1, math.ceil((len(self.queue) + 1) / rate))))
        return 1 if recent else 5

    def _dispatch(self) -> None:
        now = self._clock()
        while (entry := self.queue.peek()) is not None:
            replica_id = self.pool.choose(entry.request)
            if replica_id is None:
                return
            request = entry.request
            self._dequeue(request.request_id)
            if entry.future is None or entry.future.done():
                continue  # the caller went away
            self.pool.assign(replica_id, request, now)
            self._dispatch_times.append(now)
            wait = now - entry.arrival
            self.metrics.record_dispatch(replica_id, request.priority, wait)
            entry.future.set_result(AdmitResult(replica_id, queue_wait_s=wait))

    def tick(self) -> None:
        """Periodic: drop silent replicas, fail queued requests when no replica is live."""
        now = self._clock()
        self.pool.expire(now)
        self.metrics.live_replicas.set(len(self.pool.views))
        self.metrics.refresh_depths(self.queue.depth_by_priority)
        if self.pool.views:
            self._no_replica_since = None
        elif self._no_replica_since is None:
            self._no_replica_since = now
        elif now - self._no_replica_since >= self.config.no_replica_timeout_s:
            self._fail_all(ErrorInfo(503, "no engine replica is available", "service_unavailable",
                                     retry_after_s=5))
        self._dispatch()

    def _fail_all(self, error: ErrorInfo) -> None:
        for entry in self.queue.entries():
            self._dequeue(entry.request.request_id)
            if entry.future is not None and not entry.future.done():
                self.metrics.rejections.inc(tags={"reason": "no_replica"})
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
            await asyncio.sleep(_TICK_S if self.queue else _IDLE_TICK_S)
            self.tick()
