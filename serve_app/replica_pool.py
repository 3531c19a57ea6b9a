"""The router's view of the engine replicas: load estimates, headroom, replica choice.

Owns: one `ReplicaView` per live replica (its last report plus the admissions it has not yet
reported), the set of replicas that may take a request now, and the choice among them (least
loaded; among near-ties one holding the request's LoRA adapter, then prefix affinity: a bounded
imbalance, as Ray Serve's multiplexing keeps, never a queue behind a busy holder). Estimates are
kept incrementally and only replicas with headroom are considered, so a routing event costs
O(replicas with headroom), small exactly when the queue is long. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, ReplicaStats

_MAX_PREFIXES_PER_REPLICA = 8192
_PENDING_EXPIRY_S = 10.0  # an admitted request that never reached its replica stops counting


@dataclass(slots=True)
class ReplicaView:
    """The router's picture of one replica: its last report plus admissions since."""

    stats: ReplicaStats
    last_seen: float  # router clock of the last report
    pending: dict[str, tuple[int, float]] = field(default_factory=dict)  # request id -> (blocks, admitted at)
    num_pending_blocks: int = 0  # sum of pending blocks
    active: set[str] = field(default_factory=set)  # admitted, not yet released
    ended: set[str] = field(default_factory=set)  # released, still in the engine's last counts
    reported_ended: set[str] = field(default_factory=set)  # reported as ended, release not yet seen
    prefixes: OrderedDict = field(default_factory=OrderedDict)  # prefix hash -> None (LRU)
    adapters: set[str] = field(default_factory=set)  # LoRA adapters its engine holds (or was sent lately)
    sent_adapters: dict[str, float] = field(default_factory=dict)  # adapter -> when a request for it was admitted

    def est_waiting(self) -> int:
        """The engine's waiting queue once it has what it was sent. A slot-bound engine (or one
        with free slots) runs up to max_num_seqs and queues the rest: the requests it had at its
        last report, less those that ended since, plus the admissions it has not seen, over its
        slots. Admissions thus fill free slots at once and a slot freed by an ended request is
        refilled at its release, not a report later (the engine reports once per output interval).
        An engine queueing with slots free is short of KV blocks: its queue as reported, less the
        ended, plus the unseen. Each end counts once, whether its release or the report showing it
        comes first."""
        s = self.stats
        if s.num_waiting and s.num_running < s.max_num_seqs:
            return max(s.num_waiting - len(self.ended), 0) + len(self.pending)
        in_engine = s.num_running + s.num_waiting - len(self.ended) + len(self.pending)
        return max(in_engine - s.max_num_seqs, 0)

    def est_free_blocks(self) -> int:
        return self.stats.num_free_blocks - self.num_pending_blocks

    def is_idle(self) -> bool:
        return self.stats.num_waiting == 0 and self.stats.num_running == 0 and not self.pending

    def load(self) -> float:
        """Estimated KV demand / KV size: blocks in use, blocks of unseen admissions, and the
        blocks the engine's queued tokens will take."""
        total = max(self.stats.num_total_blocks, 1)
        queued = self.stats.num_queued_tokens / max(self.stats.block_size, 1)
        return (total - self.est_free_blocks() + queued) / total

    def blocks_needed(self, num_prompt_tokens: int) -> int:
        return math.ceil((num_prompt_tokens + 1) / max(self.stats.block_size, 1))

    def add_pending(self, request_id: str, blocks: int, now: float) -> None:
        self.pending[request_id] = (blocks, now)
        self.num_pending_blocks += blocks

    def drop_pending(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.num_pending_blocks -= entry[0]

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
    # Invariant: `_open` holds exactly the ready views that are idle or whose estimated waiting
    # queue is below max_waiting_per_replica; every method that changes a view re-files it.
    def __init__(self, config: RouterConfig):
        self.config = config
        self.views: dict[str, ReplicaView] = {}
        self._open: set[str] = set()
        self._owner: dict[str, str] = {}  # request_id -> replica_id while active

    @property
    def num_ready(self) -> int:
        return sum(1 for v in self.views.values() if v.stats.ready)

    def _refile(self, view: ReplicaView) -> None:
        rid = view.stats.replica_id
        if view.stats.ready and (view.is_idle() or view.est_waiting() < self.config.max_waiting_per_replica):
            self._open.add(rid)
        else:
            self._open.discard(rid)

    def report(self, stats: ReplicaStats, now: float) -> None:
        view = self.views.get(stats.replica_id)
        if view is None:
            view = self.views[stats.replica_id] = ReplicaView(stats, now)
        view.stats, view.last_seen = stats, now
        view.sent_adapters = {a: t for a, t in view.sent_adapters.items() if now - t <= _PENDING_EXPIRY_S}
        view.adapters = set(stats.adapters) | set(view.sent_adapters)
        for request_id in stats.ended_ids:
            if request_id in view.ended:
                view.ended.discard(request_id)
            elif request_id in view.active:  # its release is still to come
                view.reported_ended.add(request_id)
        for request_id in stats.received_ids:
            view.drop_pending(request_id)
        for request_id, (_, admitted_at) in list(view.pending.items()):
            if now - admitted_at > _PENDING_EXPIRY_S:
                view.drop_pending(request_id)
        self._refile(view)

    def expire(self, now: float) -> list[str]:
        """Drops replicas silent for longer than replica_stale_after_s; returns their ids."""
        gone = [rid for rid, v in self.views.items() if now - v.last_seen > self.config.replica_stale_after_s]
        for rid in gone:
            self.remove(rid)
        return gone

    def remove(self, replica_id: str) -> None:
        view = self.views.pop(replica_id, None)
        self._open.discard(replica_id)
        if view is not None:
            for request_id in view.active:
                self._owner.pop(request_id, None)

    def has_headroom(self, view: ReplicaView, request: AdmitRequest) -> bool:
        return view.is_idle() or view.est_free_blocks() >= view.blocks_needed(request.num_prompt_tokens)

    def choose(self, request: AdmitRequest) -> str | None:
        """The replica to send `request` to, or None if no live replica has headroom."""
        ready = [v for v in map(self.views.__getitem__, self._open) if self.has_headroom(v, request)]
        if not ready:
            return None
        least = min(v.load() for v in ready)
        tied = [v for v in ready if v.load() <= least + self.config.affinity_load_slack]
        best = min(tied, key=lambda v: (request.adapter is not None and request.adapter not in v.adapters,
                                        -v.prefix_match(request.prefix_hashes), v.load(),
                                        v.est_waiting() + v.stats.num_running, v.stats.replica_id))
        return best.stats.replica_id

    def assign(self, replica_id: str, request: AdmitRequest, now: float) -> None:
        view = self.views[replica_id]
        view.add_pending(request.request_id, view.blocks_needed(request.num_prompt_tokens), now)
        view.active.add(request.request_id)
        view.remember_prefixes(request.prefix_hashes)
        if request.adapter is not None:
            view.adapters.add(request.adapter)
            view.sent_adapters[request.adapter] = now
        self._owner[request.request_id] = replica_id
        self._refile(view)

    def release(self, request_id: str) -> None:
        replica_id = self._owner.pop(request_id, None)
        view = self.views.get(replica_id) if replica_id is not None else None
        if view is not None:
            view.active.discard(request_id)
            if request_id in view.pending:  # never reached the engine
                view.drop_pending(request_id)
            elif request_id in view.reported_ended:  # the counts already show it
                view.reported_ended.discard(request_id)
            else:
                view.ended.add(request_id)
            self._refile(view)
