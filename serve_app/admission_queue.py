"""The router's admission queue: ordered by the engine's ranking rule, bounded, O(log n).

Owns: the order of waiting admissions (engine.scheduler.queue.rank_key, so the fleet-wide queue
and each engine's waiting queue rank a request alike), the bounds (requests, work tokens), and
per-priority depth counters. With one aging rate for all, a waiting request's key never changes,
so the queue is a heap with lazy deletion (engine/lazy_heap.py, the engine queue's): push,
pop, cancel and depth are O(log n) or O(1).
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
    future: asyncio.Future | None = None  # set by Router; None in pure-queue tests


class AdmissionQueue:
    def __init__(self, config: RouterConfig):
        self.config = config
        self._heap: LazyHeap[QueueEntry] = LazyHeap()
        self.num_tokens = 0  # work tokens (prompt + n * max_tokens) of the queued requests
        self.depth_by_priority: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._heap)

    def can_accept(self, request: AdmitRequest) -> bool:
        return (len(self._heap) < self.config.max_queued_requests
                and self.num_tokens + request.num_work_tokens <= self.config.max_queued_tokens)

    def key(self, request: AdmitRequest, arrival: float) -> float:
        work = estimated_work(request.num_prompt_tokens, request.max_tokens)
        return rank_key(self.config.policy, self.config.aging_rate, request.priority, work, arrival)

    def push(self, request: AdmitRequest, now: float) -> QueueEntry:
        self.remove(request.request_id)  # at most once
        entry = QueueEntry(request, now)
        self._heap.push(request.request_id, self.key(request, now), now, entry)
        self.num_tokens += request.num_work_tokens
        self.depth_by_priority[request.priority] += 1
        return entry

    def remove(self, request_id: str) -> QueueEntry | None:
        entry = self._heap.remove(request_id)
        if entry is not None:
            self.num_tokens -= entry.request.num_work_tokens
            self.depth_by_priority[entry.request.priority] -= 1
        return entry

    def peek(self) -> QueueEntry | None:
        """The best-ranked queued entry, or None."""
        return self._heap.peek()

    def entries(self) -> list[QueueEntry]:
        return self._heap.items()
