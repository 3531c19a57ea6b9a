"""Global admission: one queue ordered by policy, dispatch to the replica with headroom.

Owns: the admission queue (fcfs | sjf | priority, with aging), its bounds (-> 429 + Retry-After),
the per-replica load view fed by replica reports, and replica choice (least loaded, prefix
affinity among near-ties). Does not own: tokens. The router is off the token path: `admit()`
returns the replica's id, the ingress streams from that replica directly and calls `release()`.

Invariants (checked by tests):
- A request leaves the queue only when some live replica has headroom: its estimated waiting
  queue is below `max_waiting_per_replica` and its estimated free KV blocks cover the prompt
  (an idle replica always has headroom, so a prompt larger than free blocks cannot deadlock).
- Dispatch is strictly in key order: if the best request fits nowhere, nobody overtakes it.
- Estimates = last report + what was admitted to that replica but not yet seen by its engine
  (replicas list the request ids that reached them since their previous report), so the
  router never polls per request.

Key (smaller = sooner), `w` = seconds waited, `a` = aging_rate (the engine's rule, see
engine/scheduler/queue.py): fcfs: arrival; priority: (priority - a*w, arrival);
sjf: (prompt + max_new_tokens - a*w, arrival).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, AdmitResult, ErrorInfo, ReplicaStats
from serve_app.metrics import RouterMetrics

_MAX_PREFIXES_PER_REPLICA = 8192
_PENDING_EXPIRY_S = 10.0  # an admitted request that never reached its replica stops counting


@dataclass(slots=True)
class QueueEntry:
    request: AdmitRequest
    arrival: float  # router clock
    seq: int  # FIFO tie-breaker
    future: asyncio.Future | None = None  # set by Router; None in pure-queue tests

    @property
    def work_tokens(self) -> int:
        return self.request.num_prompt_tokens + self.request.max_new_tokens


class AdmissionQueue:
    """The ordered, bounded waiting room. Pure: time is passed in."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self._entries: dict[str, QueueEntry] = {}
        self._num_tokens = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def can_accept(self, request: AdmitRequest) -> bool:
        work = request.num_prompt_tokens + request.max_new_tokens
        if len(self._entries) >= self.config.max_queued_requests:
            return False
        # A lone request larger than the token bound is still accepted into an empty queue.
        return not self._entries or self._num_tokens + work <= self.config.max_queued_tokens

    def push(self, request: AdmitRequest, now: float) -> QueueEntry:
        entry = QueueEntry(request, now, self._seq)
        self._seq += 1
        self._entries[request.request_id] = entry
        self._num_tokens += entry.work_tokens
        return entry

    def remove(self, request_id: str) -> QueueEntry | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._num_tokens -= entry.work_tokens
        return entry

    def key(self, entry: QueueEntry, now: float) -> tuple[float, int]:
        aged = self.config.aging_rate * (now - entry.arrival)
        if self.config.policy == "priority":
            return (entry.request.priority - aged, entry.seq)
        if self.config.policy == "sjf":
            return (entry.work_tokens - aged, entry.seq)
        return (entry.arrival, entry.seq)

    def peek(self, now: float) -> QueueEntry | None:
        if not self._entries:
            return None
        return min(self._entries.values(), key=lambda e: self.key(e, now))

    def entries(self) -> list[QueueEntry]:
        return list(self._entries.values())

    def depth_by_priority(self) -> dict[int, int]:
        depth: dict[int, int] = {}
        for e in self._entries.values():
            depth[e.request.priority] = depth.get(e.request.priority, 0) + 1
        return depth


@dataclass(slots=True)
class ReplicaView:
    """The router's picture of one replica: its last report plus admissions since."""

    stats: ReplicaStats
    last_seen: float  # router clock of the last report
    pending: dict = field(default_factory=dict)  # request_id -> (blocks, router time), unseen
    active: set[str] = field(default_factory=set)  # admitted, not yet released
    prefixes: OrderedDict = field(default_factory=OrderedDict)  # prefix hash -> None (LRU)

    def num_unseen(self) -> int:
        return len(self.pending)

    def est_waiting(self) -> int:
        return self.stats.num_waiting + self.num_unseen()

    def est_free_blocks(self) -> int:
        return self.stats.num_free_blocks - sum(blocks for blocks, _ in self.pending.values())

    def is_idle(self) -> bool:
        return self.stats.num_waiting == 0 and self.stats.num_running == 0 and not self.pending

    def load(self) -> float:
        """Estimated KV demand / KV size: blocks in use, blocks of unseen admissions, and the
        blocks the engine's queued prompt tokens will take."""
        total = max(self.stats.num_total_blocks, 1)
        queued = self.stats.num_queued_tokens / max(self.stats.block_size, 1)
        return (total - self.est_free_blocks() + queued) / total

    def prefix_match(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            n += 1
        return n

    def remember_prefixes(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > _MAX_PREFIXES_PER_REPLICA:
            self.prefixes.popitem(last=False)


class ReplicaPool:
    """Live replicas' load views; headroom test and replica choice. Pure: time is passed in."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.views: dict[str, ReplicaView] = {}
        self._owner: dict[str, str] = {}  # request_id -> replica_id while active

    def report(self, stats: ReplicaStats, now: float) -> None:
        view = self.views.get(stats.replica_id)
        if view is None:
            view = self.views[stats.replica_id] = ReplicaView(stats, now)
        view.stats, view.last_seen = stats, now
        for request_id in stats.received_ids:
            view.pending.pop(request_id, None)
        for request_id, (_, admitted_at) in list(view.pending.items()):
            if now - admitted_at > _PENDING_EXPIRY_S:
                del view.pending[request_id]

    def expire(self, now: float) -> list[str]:
        """Drops replicas silent for longer than replica_stale_after_s; returns their ids."""
        gone = [
            rid
            for rid, v in self.views.items()
            if now - v.last_seen > self.config.replica_stale_after_s
        ]
        for rid in gone:
            self.remove(rid)
        return gone

    def remove(self, replica_id: str) -> None:
        view = self.views.pop(replica_id, None)
        if view is not None:
            for request_id in view.active:
                self._owner.pop(request_id, None)

    def blocks_needed(self, view: ReplicaView, num_prompt_tokens: int) -> int:
        return math.ceil((num_prompt_tokens + 1) / max(view.stats.block_size, 1))

    def has_headroom(self, view: ReplicaView, request: AdmitRequest) -> bool:
        if view.is_idle():
            return True
        return (
            view.est_waiting() < self.config.max_waiting_per_replica
            and view.est_free_blocks() >= self.blocks_needed(view, request.num_prompt_tokens)
        )

    def choose(self, request: AdmitRequest) -> str | None:
        """The replica to send `request` to, or None if no live replica has headroom."""
        ready = [v for v in self.views.values() if self.has_headroom(v, request)]
        if not ready:
            return None
        least = min(v.load() for v in ready)
        tied = [v for v in ready if v.load() <= least + self.config.affinity_load_slack]
        best = min(
            tied,
            key=lambda v: (
                -v.prefix_match(request.prefix_hashes),
                v.load(),
                v.est_waiting() + v.stats.num_running,
                v.stats.replica_id,
            ),
        )
        return best.stats.replica_id

    def assign(self, replica_id: str, request: AdmitRequest, now: float) -> None:
        view = self.views[replica_id]
        view.pending[request.request_id] = (
            self.blocks_needed(view, request.num_prompt_tokens), now
        )
        view.active.add(request.request_id)
        view.remember_prefixes(request.prefix_hashes)
        self._owner[request.request_id] = replica_id

    def release(self, request_id: str) -> None:
        replica_id = self._owner.pop(request_id, None)
        if replica_id is not None and replica_id in self.views:
            self.views[replica_id].active.discard(request_id)
            self.views[replica_id].pending.pop(request_id, None)


class Router:
    """The Router deployment (plain class; `app.py` applies serve.deployment).

    admit() waits in the global queue until a replica has headroom and names it; release() when
    the request ends; report() is called by replicas with their load snapshot.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics_enabled: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.queue = AdmissionQueue(config)
        self.pool = ReplicaPool(config)
        self.metrics = RouterMetrics(metrics_enabled)
        self._clock = clock
        self._dispatch_times: deque[float] = deque(maxlen=512)
        self._priorities_seen: set[int] = set()
        self._no_replica_since: float | None = None
        self._tick_task: asyncio.Task | None = None
        self._maybe_start_ticker()

    # ------------------------------------------------------------ deployment methods

    async def admit(self, request: AdmitRequest) -> AdmitResult:
        self._maybe_start_ticker()
        now = self._clock()
        if not self.queue.can_accept(request):
            self.metrics.rejections.inc(tags={"reason": "queue_full"})
            retry = self.retry_after_s()
            return AdmitResult(
                None,
                ErrorInfo(
                    429,
                    f"admission queue full ({len(self.queue)} requests, {self.queue.num_tokens} "
                    f"tokens queued; limits {self.config.max_queued_requests} requests, "
                    f"{self.config.max_queued_tokens} tokens); retry in {retry}s",
                    type="rate_limit_exceeded",
                    retry_after_s=retry,
                ),
            )
        entry = self.queue.push(request, now)
        entry.future = asyncio.get_running_loop().create_future()
        self._priorities_seen.add(request.priority)
        self._dispatch()
        self._record_queue()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.queue.remove(request.request_id)
            if entry.future.done() and not entry.future.cancelled():
                self.pool.release(request.request_id)
            self._record_queue()
            raise

    async def release(self, request_id: str) -> None:
        self.pool.release(request_id)
        self._dispatch()

    async def report(self, stats: ReplicaStats) -> None:
        self.pool.report(stats, self._clock())
        self._dispatch()

    async def remove_replica(self, replica_id: str) -> None:
        """Called by the ingress when a replica's stream failed (actor died): stop sending
        there now instead of waiting for its reports to go stale. A live replica that keeps
        reporting comes back with its next report."""
        self.pool.remove(replica_id)
        self._dispatch()

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
        while True:
            entry = self.queue.peek(now)
            if entry is None:
                break
            replica_id = self.pool.choose(entry.request)
            if replica_id is None:
                break
            self.queue.remove(entry.request.request_id)
            if entry.future is None or entry.future.done():
                continue  # the caller went away
            self.pool.assign(replica_id, entry.request, now)
            self._dispatch_times.append(now)
            wait = now - entry.arrival
            priority = str(entry.request.priority)
            self.metrics.admission_wait.observe(wait, tags={"priority": priority})
            self.metrics.dispatched.inc(tags={"replica": replica_id, "priority": priority})
            entry.future.set_result(AdmitResult(replica_id, queue_wait_s=wait))
        self._record_queue()

    def tick(self) -> None:
        """Periodic: drop silent replicas, fail queued requests when no replica is live."""
        now = self._clock()
        self.pool.expire(now)
        self.metrics.live_replicas.set(len(self.pool.views))
        if self.pool.views:
            self._no_replica_since = None
        elif self._no_replica_since is None:
            self._no_replica_since = now
        elif now - self._no_replica_since >= self.config.no_replica_timeout_s:
            self._fail_all(
                ErrorInfo(503, "no engine replica is available", "service_unavailable", None, 5)
            )
        self._dispatch()

    def _fail_all(self, error: ErrorInfo) -> None:
        for entry in self.queue.entries():
            self.queue.remove(entry.request.request_id)
            if entry.future is not None and not entry.future.done():
                self.metrics.rejections.inc(tags={"reason": "no_replica"})
                entry.future.set_result(AdmitResult(None, error))

    def _record_queue(self) -> None:
        self.metrics.record_queue(self.queue.depth_by_priority(), self._priorities_seen)

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
            await asyncio.sleep(0.1)
            self.tick()
