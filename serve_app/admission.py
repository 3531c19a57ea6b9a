"""The router's admission queue: ordered by the engine's ranking rule, bounded, O(log n).

Owns: the order of waiting admissions (engine.scheduler.queue.rank_key, so the fleet-wide queue
and each engine's waiting queue rank a request alike), the bounds (requests, work tokens), and
per-priority depth counters. With one aging rate for all, a waiting request's key never changes,
so the queue is a heap with lazy deletion: push, pop, cancel and depth are O(log n) or O(1).
Pure: time is passed in.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass

from engine.scheduler.queue import estimated_work, rank_key
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest


@dataclass(slots=True)
class QueueEntry:
    request: AdmitRequest
    arrival: float  # router clock
    seq: int  # FIFO tie-breaker
    future: asyncio.Future | None = None  # set by Router; None in pure-queue tests


class AdmissionQueue:
    # Invariant: `_entries` holds the live entries; the heap may also hold entries removed since
    # (stale: their id is gone from `_entries` or maps to a newer entry), skipped when met.
    def __init__(self, config: RouterConfig):
        self.config = config
        self._entries: dict[str, QueueEntry] = {}
        self._heap: list[tuple[float, float, int, QueueEntry]] = []
        self._seq = itertools.count()
        self.num_tokens = 0  # work tokens (prompt + n * max_tokens) of the queued requests
        self.depth_by_priority: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def can_accept(self, request: AdmitRequest) -> bool:
        return (len(self._entries) < self.config.max_queued_requests
                and self.num_tokens + request.num_work_tokens <= self.config.max_queued_tokens)

    def key(self, request: AdmitRequest, arrival: float) -> float:
        work = estimated_work(request.num_prompt_tokens, request.max_tokens)
        return rank_key(self.config.policy, self.config.aging_rate, request.priority, work, arrival)

    def push(self, request: AdmitRequest, now: float) -> QueueEntry:
        entry = QueueEntry(request, now, next(self._seq))
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, (self.key(request, now), now, entry.seq, entry))
        self.num_tokens += request.num_work_tokens
        self.depth_by_priority[request.priority] += 1
        return entry

    def remove(self, request_id: str) -> QueueEntry | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.num_tokens -= entry.request.num_work_tokens
            self.depth_by_priority[entry.request.priority] -= 1
            if len(self._heap) > 2 * len(self._entries) + 64:  # mostly stale: rebuild, O(n) amortised
                self._heap = [item for item in self._heap if self._is_live(item[3])]
                heapq.heapify(self._heap)
        return entry

    def _is_live(self, entry: QueueEntry) -> bool:
        return self._entries.get(entry.request.request_id) is entry

    def peek(self) -> QueueEntry | None:
        """The best-ranked queued entry, or None."""
        while self._heap and not self._is_live(self._heap[0][3]):
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def entries(self) -> list[QueueEntry]:
        return list(self._entries.values())
