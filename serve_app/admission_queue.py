"""The router's admission queue (one a model): ordered by the engine's ranking rule, each LoRA
adapter's flow its fair share of its class, bounded, O(log n) a request.

Owns: the order of waiting admissions (engine.scheduler.queue.rank_key, so the fleet-wide queue
and each engine's waiting queue rank a request alike), the bounds (requests, work tokens), and
per-priority depth counters. With one aging rate for all, a waiting request's key never changes,
so each flow is a heap with lazy deletion (engine/lazy_heap.py, the engine queue's).

Flows: the requests of one adapter (the base model's are a flow too). The next request is a
flow's best-ranked, in rank order across flows, except that among the flows whose best request
is of the best request's priority class, the one served longest ago in that class goes first:
a burst for one adapter takes its turn with the class's other adapters, never all of the class's
dispatches. With one flow (no adapters) this is the plain rank order. A flow's own requests
never overtake each other.
Pure: time is passed in.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from engine.lazy_heap import LazyHeap
from engine.scheduler.queue import estimated_work, rank_key
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest


@dataclass(slots=True)
class QueueEntry:
    request: AdmitRequest
    arrival: float  # router clock
    key: float = 0.0  # its rank (lower = sooner)
    future: asyncio.Future | None = None  # set by Router; None in pure-queue tests


class AdmissionQueue:
    def __init__(self, config: RouterConfig):
        self.config = config
        self._flows: dict[str | None, LazyHeap[QueueEntry]] = {}  # by adapter (None: the base), non-empty
        self._flow_of: dict[str, str | None] = {}  # request id -> its flow
        self._served: dict[tuple[int, str | None], int] = {}  # (class, flow) -> when it was last served
        self._num_served = 0
        self.num_tokens = 0  # work tokens (prompt + n * max_tokens) of the queued requests
        self.depth_by_priority: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._flow_of)

    def can_accept(self, request: AdmitRequest) -> bool:
        return (len(self._flow_of) < self.config.max_queued_requests
                and self.num_tokens + request.num_work_tokens <= self.config.max_queued_tokens)

    def key(self, request: AdmitRequest, arrival: float) -> float:
        work = estimated_work(request.num_prompt_tokens, request.max_tokens)
        return rank_key(self.config.policy, self.config.aging_rate, request.priority, work, arrival)

    def push(self, request: AdmitRequest, now: float) -> QueueEntry:
        self.remove(request.request_id)  # at most once
        entry = QueueEntry(request, now, self.key(request, now))
        flow = self._flows.get(request.adapter)
        if flow is None:
            flow = self._flows[request.adapter] = LazyHeap()
        flow.push(request.request_id, entry.key, now, entry)
        self._flow_of[request.request_id] = request.adapter
        self.num_tokens += request.num_work_tokens
        self.depth_by_priority[request.priority] += 1
        return entry

    def remove(self, request_id: str) -> QueueEntry | None:
        if request_id not in self._flow_of:
            return None
        adapter = self._flow_of.pop(request_id)
        flow = self._flows[adapter]
        entry = flow.remove(request_id)
        assert entry is not None
        if not flow:
            del self._flows[adapter]
        self.num_tokens -= entry.request.num_work_tokens
        self.depth_by_priority[entry.request.priority] -= 1
        return entry

    def peek(self) -> QueueEntry | None:
        """The entry to serve next: the best-ranked, or, where flows of its class wait, the best of
        the flow of that class served longest ago. None when empty."""
        heads = [head for flow in self._flows.values() if (head := flow.peek()) is not None]  # flows are non-empty
        if len(heads) <= 1:
            return heads[0] if heads else None
        best = min(heads, key=_rank)
        priority = best.request.priority
        return min((h for h in heads if h.request.priority == priority),
                   key=lambda h: (self._served.get((priority, h.request.adapter), -1), _rank(h)))

    def served(self, entry: QueueEntry) -> None:
        """`entry` (just taken out) was dispatched: its flow's turn in its class is over."""
        if len(self._flows) > 1 or self._served:
            self._num_served += 1
            self._served[entry.request.priority, entry.request.adapter] = self._num_served
            if not self._flow_of:  # nothing waits: turns start over
                self._served.clear()

    def entries(self) -> list[QueueEntry]:
        return [entry for flow in self._flows.values() for entry in flow.items()]


def _rank(entry: QueueEntry) -> tuple[float, float]:
    return entry.key, entry.arrival
