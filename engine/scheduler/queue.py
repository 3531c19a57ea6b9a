"""Ordering of waiting requests: FCFS, SJF and priority, with aging. The one home of the ranking
rule: the serve app's admission router imports `rank_key` and `estimated_work` from here.

Aging lowers (improves) a waiting request's rank by `aging_rate` per second: for `priority` a
request of class p that arrived at a ranks at time t as p - aging_rate * (t - a); for `sjf` its
estimated work shrinks by aging_rate tokens per second. With one rate for everyone that order
is the order of p + aging_rate * a, a key that does not change while the request waits, so the
queue is a heap (O(log n) per add, pop and removal) instead of a sort per step.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from engine.request import Request

LengthPredictor = Callable[[Request], float]


def estimated_work(num_uncomputed_tokens: int, num_remaining_outputs: int) -> float:
    """SJF's estimate of a request's remaining work in tokens."""
    return float(num_uncomputed_tokens + num_remaining_outputs)


def default_remaining_work(request: Request) -> float:
    return estimated_work(request.num_uncomputed_tokens,
                          request.params.max_tokens - request.num_output_tokens)


def rank_key(policy: str, aging_rate: float, priority: int, work: float, arrival_time: float) -> float:
    """Lower is served first. The aged rank at any time t is this key minus aging_rate * t, the
    same shift for everyone, so comparing keys compares aged ranks. FCFS (and static) is arrival
    order; ties are broken by the caller (arrival, then insertion order)."""
    if policy == "sjf":
        return work + aging_rate * arrival_time
    if policy == "priority":
        return priority + aging_rate * arrival_time
    return arrival_time


class WaitingQueue:
    # Invariant: every request in `_requests` has exactly one live heap entry, the one whose
    # sequence number `_requests` holds; other heap entries are stale (removed) and skipped.
    def __init__(self, policy: str, aging_rate: float, predictor: LengthPredictor = default_remaining_work):
        self.policy = policy
        self.aging_rate = aging_rate
        self.predictor = predictor
        self._heap: list[tuple[float, float, int, Request]] = []
        self._requests: dict[str, tuple[int, Request]] = {}  # request id -> (live entry seq, request)
        self._seq = itertools.count()
        self.num_tokens = 0  # tokens of the waiting requests (prompt, plus outputs for re-queued ones)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def key(self, request: Request) -> float:
        """The request's rank key (see rank_key); valid while the request waits or runs."""
        return rank_key(self.policy, self.aging_rate, request.priority, self.predictor(request), request.arrival_time)

    def add(self, request: Request) -> None:
        seq = next(self._seq)
        self._requests[request.request_id] = (seq, request)
        heapq.heappush(self._heap, (self.key(request), request.arrival_time, seq, request))
        self.num_tokens += request.num_tokens

    def remove(self, request_id: str) -> Request | None:
        """Takes the request out (its heap entry goes stale); None if it is not waiting."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        self.num_tokens -= entry[1].num_tokens
        if len(self._heap) > 2 * len(self._requests) + 64:  # stale entries: drop them, O(n) amortised
            self._heap = [e for e in self._heap if self._requests.get(e[3].request_id, (None,))[0] == e[2]]
            heapq.heapify(self._heap)
        return entry[1]

    def peek(self) -> Request | None:
        """The best-ranked waiting request, or None."""
        heap = self._heap
        while heap:
            seq, request = heap[0][2], heap[0][3]
            live = self._requests.get(request.request_id)
            if live is not None and live[0] == seq:
                return request
            heapq.heappop(heap)
        return None

    def pop(self) -> Request | None:
        request = self.peek()
        if request is not None:
            heapq.heappop(self._heap)
            self.remove(request.request_id)
        return request

    def requests(self) -> list[Request]:
        """Waiting requests, unordered."""
        return [request for _, request in self._requests.values()]
